"""The overload benchmark's figures: percentiles, goodput, coverage, lag, merging."""

from __future__ import annotations

import math

import pytest

from bench.harness.send_result import SendResult, in_window, lag_summary, merge_results
from bench.harness.stats import quantile
from bench.overload.stats import by_tenant, coverage, goodput_per_s, ratio, summarize, summarize_streams


def result(scheduled_s: float = 0.0, latency_s: float = 0.01, status: str = "OK", lag_s: float = 0.0,
           leaf_stage_us: int = 0, tenant: str = "a", ttft_s: float | None = None, num_tokens: int = 0) -> SendResult:
    return SendResult(tenant, scheduled_s, scheduled_s + lag_s, scheduled_s + latency_s, status, leaf_stage_us,
                      ttft_s, num_tokens)


def test_quantile_is_the_nearest_rank():
    values = list(range(1, 101))
    assert quantile(values, 0.5) == 50
    assert quantile(values, 0.99) == 99
    assert quantile(values, 1.0) == 100
    assert quantile(values, 0.0) == 1
    assert quantile([3.0], 0.99) == 3.0
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\], got 99"):
        quantile(values, 99)


def test_merge_results_orders_every_processs_results_by_scheduled_time():
    first = [result(0.0), result(0.2)]
    second = [result(0.1), result(0.3)]
    merged = merge_results([first, second])
    assert [r.scheduled_s for r in merged] == [0.0, 0.1, 0.2, 0.3]


def test_in_window_keeps_what_was_scheduled_in_the_half_open_window():
    results = [result(t) for t in (0.5, 1.0, 1.5, 3.0)]
    assert [r.scheduled_s for r in in_window(results, 1.0, 3.0)] == [1.0, 1.5]


def test_goodput_counts_successes_within_the_deadline_from_the_scheduled_time():
    results = [
        result(latency_s=0.05),
        result(latency_s=0.1),  # exactly at the deadline: good
        result(latency_s=0.101),  # ok, but late
        result(latency_s=0.01, status="RESOURCE_EXHAUSTED"),
        result(latency_s=0.05, lag_s=0.04),  # late generator: still inside from the scheduled time
    ]
    assert goodput_per_s(results, deadline_s=0.1, window_s=2.0) == 1.5
    with pytest.raises(ValueError, match="window_s must be > 0, got 0"):
        goodput_per_s(results, 0.1, 0)


def test_coverage_around_the_median_and_in_the_tail_uses_those_requests_only():
    # 100 requests: the fast 99 are fully covered by stages, the slowest one only 20%.
    results = [result(latency_s=0.010 + i * 1e-5, leaf_stage_us=round((0.010 + i * 1e-5) * 1e6)) for i in range(99)]
    results.append(result(latency_s=1.0, leaf_stage_us=200_000))
    assert coverage(results, 0.5) == pytest.approx(1.0, abs=1e-3)
    # The tail band (ranks from 97% up) sums 2 covered requests with the uncovered one.
    tail = coverage(results, 0.99)
    assert tail == pytest.approx((0.01097 + 0.01098 + 0.2) / (0.01097 + 0.01098 + 1.0), rel=1e-3)


def test_coverage_ignores_failures_and_is_nan_without_successes():
    assert math.isnan(coverage([result(status="UNAVAILABLE", leaf_stage_us=5)], 0.5))
    mixed = [result(latency_s=0.01, leaf_stage_us=5000), result(latency_s=0.01, status="UNAVAILABLE")]
    assert coverage(mixed, 0.5) == pytest.approx(0.5)


def test_lag_summary_flags_a_generator_whose_p99_lag_exceeds_the_threshold():
    on_time = [result(i / 100, lag_s=0.001) for i in range(100)]
    assert not lag_summary(on_time, threshold_ms=5.0).fell_behind
    late = on_time[:97] + [result(1.0, lag_s=0.02) for _ in range(3)]
    summary = lag_summary(late, threshold_ms=5.0)
    assert summary.fell_behind
    assert summary.p99_ms == pytest.approx(20.0)
    assert summary.p50_ms == pytest.approx(1.0)


def test_summarize_counts_errors_by_code_and_takes_latency_of_successes_only():
    results = [result(latency_s=0.01 * (i + 1)) for i in range(10)]
    results += [result(status="DEADLINE_EXCEEDED", latency_s=5.0)] * 2 + [result(status="UNAVAILABLE")]
    summary = summarize(results, window_s=2.0, deadline_s=0.05, lag_threshold_ms=5.0)
    assert summary["num_requests"] == 13
    assert summary["num_ok"] == 10
    assert summary["errors"] == {"DEADLINE_EXCEEDED": 2, "UNAVAILABLE": 1}
    assert summary["offered_per_s"] == 6.5
    assert summary["goodput_per_s"] == 2.5
    assert summary["p50_ms"] == pytest.approx(50.0)
    assert summary["p99_ms"] == pytest.approx(100.0)
    assert summary["generator_fell_behind"] is False


def test_summarize_streams_reports_ttft_and_e2e_of_successful_streams():
    streams = [result(latency_s=0.5 + i / 100, ttft_s=0.02 + i / 1000, num_tokens=10) for i in range(10)]
    streams.append(result(status="DEADLINE_EXCEEDED", latency_s=5.0))
    summary = summarize_streams(streams, window_s=5.0, lag_threshold_ms=5.0)
    assert summary["num_streams"] == 11 and summary["num_ok"] == 10
    assert summary["ttft_p99_ms"] == pytest.approx(29.0)
    assert summary["e2e_p50_ms"] == pytest.approx(540.0)
    assert summary["output_tokens_per_s"] == 20.0


def test_by_tenant_groups_and_ratio_handles_missing_values():
    groups = by_tenant([result(tenant="a"), result(tenant="b"), result(tenant="a")])
    assert {k: len(v) for k, v in groups.items()} == {"a": 2, "b": 1}
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))
