import numpy as np
import pytest

from loadtest.records import CLIENT_QUEUE, OK, RequestRecord, StageSample
from loadtest.scenario import RequestKind, Slo
from loadtest.stats import LatencyHistogram, generator_lag, meets_slo, summarize_group, time_windows
from tests.unit.loadtest.conftest import make_record


def test_percentiles_match_a_known_latency_set():
    # 1..10000 ms, shuffled: the exact order statistics are known.
    values_ms = np.random.default_rng(0).permutation(np.arange(1, 10_001))
    summary = LatencyHistogram(v * 1000 for v in values_ms).summary_ms()
    assert summary["count"] == 10_000
    for key, exact_ms in (("p50", 5000), ("p90", 9000), ("p99", 9900), ("p99.9", 9990), ("max", 10_000),
                          ("min", 1), ("mean", 5000.5)):
        assert summary[key] == pytest.approx(exact_ms, rel=1e-3), key  # 3 significant digits


def test_percentiles_of_a_skewed_set_catch_the_tail():
    values_us = [1000] * 990 + [250_000] * 10  # 1% of requests are 250x slower
    summary = LatencyHistogram(values_us).summary_ms()
    assert summary["p50"] == pytest.approx(1.0, rel=1e-3)
    assert summary["p99"] == pytest.approx(1.0, rel=1e-3)
    assert summary["p99.9"] == pytest.approx(250.0, rel=1e-3)


def _stream(seq, chunk_times, scheduled_s=0.0, **over) -> RequestRecord:
    return make_record(seq, kind=RequestKind.GENERATE, class_name="gen", scheduled_s=scheduled_s, sent_s=scheduled_s,
                       done_s=chunk_times[-1] + 0.001, chunk_times_s=tuple(chunk_times),
                       num_output_tokens=len(chunk_times), **over)


def test_stream_metrics_ttft_tpot_and_itl():
    record = _stream(0, [0.100, 0.120, 0.140, 0.160, 0.180])
    assert record.ttft_s == pytest.approx(0.100)
    assert record.tpot_s == pytest.approx(0.020)
    assert record.itl_s == pytest.approx((0.02, 0.02, 0.02, 0.02))
    group = summarize_group([record], 1.0, lambda r: Slo())
    assert group["stream"]["ttft_ms"]["p50"] == pytest.approx(100.0, rel=1e-3)
    assert group["stream"]["tpot_ms"]["p50"] == pytest.approx(20.0, rel=1e-3)
    assert group["stream"]["output_tokens"] == 5


def test_goodput_counts_only_successes_within_every_slo_bound():
    slo = Slo(e2e_ms=500, ttft_ms=150, tpot_ms=30)
    fast = _stream(0, [0.1, 0.12, 0.14])
    slow_first_token = _stream(1, [0.2, 0.22, 0.24])
    slow_tokens = _stream(2, [0.1, 0.15, 0.2])
    failed = _stream(3, [0.1, 0.12], status="UNAVAILABLE")
    assert [meets_slo(r, slo) for r in (fast, slow_first_token, slow_tokens, failed)] == [True, False, False, False]
    group = summarize_group([fast, slow_first_token, slow_tokens, failed], 2.0, lambda r: slo, slo)
    assert group["goodput_ratio"] == 0.25
    assert group["goodput_rps"] == 0.5
    assert group["throughput_rps"] == 1.5
    assert group["errors"] == {"UNAVAILABLE": 1}


def test_latency_counts_from_scheduled_time_and_service_from_send():
    record = make_record(0, scheduled_s=1.0, sent_s=1.4, done_s=1.5)
    assert record.latency_s == pytest.approx(0.5)
    assert record.service_s == pytest.approx(0.1)
    assert record.stage_us()[CLIENT_QUEUE] == 400_000


def test_stage_means_add_up_to_the_mean_latency():
    records = [make_record(i, latency_s=0.01 + 0.001 * i) for i in range(50)]
    group = summarize_group(records, 1.0, lambda r: Slo())
    total = sum(v["mean_ms"] for v in group["stages"].values())
    assert total == pytest.approx(group["latency_ms"]["mean"], rel=1e-3)
    assert list(group["stages"])[:3] == ["client_queue", "queue_wait", "compute"]


def test_tail_attribution_names_the_stage_that_dominates_the_slowest_requests():
    # 990 requests dominated by compute; the 10 slowest spent their time in the queue.
    normal = [make_record(i, latency_s=0.010) for i in range(990)]
    slow = [make_record(990 + i, latency_s=0.5, stages=(StageSample("queue_wait", "scheduler", 480_000),
                                                         StageSample("compute", "worker", 15_000)),
                        server_total_us=495_000) for i in range(10)]
    group = summarize_group(normal + slow, 10.0, lambda r: Slo())
    tail = group["tail"]
    assert tail["num_requests"] == 10
    assert tail["top_stage"] == "queue_wait"
    assert tail["dominant_stage_counts"] == {"queue_wait": 10}
    assert tail["stage_mean_ms"]["queue_wait"] == pytest.approx(480.0)
    assert group["stages"]["compute"]["mean_ms"] < group["stages"]["queue_wait"]["mean_ms"] * 2


def test_aggregate_stages_are_not_counted_as_leaves():
    record = make_record(0, latency_s=0.01, stages=(StageSample("gateway", "gateway", 9000),
                                                    StageSample("compute", "worker", 8000)), server_total_us=9000)
    assert "gateway" not in record.stage_us()
    assert record.stage_us()["other"] == 1000


def test_time_windows_bucket_throughput_by_completion_and_latency_by_schedule():
    records = [make_record(i, latency_s=0.15, scheduled_s=10.0 + i * 0.1) for i in range(30)]  # 3 s at 10/s
    records.append(make_record(99, scheduled_s=11.0, status="UNAVAILABLE"))
    windows = time_windows(records, start_s=10.0, measured_s=3.0, window_s=1.0)
    assert [w["num_scheduled"] for w in windows] == [10, 11, 10]
    assert [w["num_errors"] for w in windows] == [0, 1, 0]
    assert sum(w["num_ok"] for w in windows) == 29  # the last one completes after the measured period
    assert windows[0]["p99_ms"] == pytest.approx(150.0, rel=1e-3)


def test_generator_lag_flags_a_generator_that_fell_behind():
    on_time = generator_lag([200] * 1000, lag_warn_ms=10)
    behind = generator_lag([200] * 980 + [50_000] * 20, lag_warn_ms=10)
    assert not on_time["fell_behind"] and on_time["num_late"] == 0
    assert behind["fell_behind"] and behind["num_late"] == 20


def test_summary_of_no_successes_has_counts_but_no_percentiles():
    group = summarize_group([make_record(0, status="UNAVAILABLE")], 1.0, lambda r: Slo())
    assert group["latency_ms"] == {"count": 0}
    assert group["tail"] is None and group["stream"] is None
    assert group["error_ratio"] == 1.0
    assert OK not in group["errors"]
