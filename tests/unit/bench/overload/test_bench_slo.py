"""bench_slo's judging of streams and its reading of the gateway's TTFT error histogram."""

from __future__ import annotations

import pytest

from bench.harness.send_result import SendResult
from bench.overload.bench_slo import (
    BATCH,
    INTERACTIVE,
    default_output,
    median_from_buckets,
    meets,
    misses,
    p99_interval_ms,
    parse_admit_ttft,
    predictor_error,
    quantile_from_buckets,
    ratio_interval,
    refusal_reasons,
    refused_within,
    scheduler_queue,
    share_over,
    stream_rows,
    templates,
)
from bench.overload.placement import Placement
from infermesh.v1 import gateway_pb2
from services.common.errors import ResourceExhausted
from services.common.objectives import LatencyObjective
from services.common.priority import Priority
from services.gateway.admission.latency_admission import check_ttft
from services.gateway.routing.pressure import PressureReport

INF = float("inf")


def _stream(ttft_s: float, latency_s: float, num_tokens: int, status: str = "OK", message: str = "") -> SendResult:
    return SendResult("interactive", 0.0, 0.0, latency_s, status, ttft_s=ttft_s, num_tokens=num_tokens,
                      message=message)


def test_a_stream_is_judged_on_ttft_and_on_the_time_per_token_after_the_first():
    assert misses(_stream(0.150, 0.150 + 10 * 0.040, 11), INTERACTIVE) == ""
    assert misses(_stream(0.250, 0.250 + 10 * 0.040, 11), INTERACTIVE) == "ttft"
    assert misses(_stream(0.150, 0.150 + 10 * 0.060, 11), INTERACTIVE) == "tpot"
    assert misses(_stream(0.250, 0.250 + 10 * 0.060, 11), INTERACTIVE) == "both"
    assert misses(_stream(0.150, 0.150, 1), INTERACTIVE) == "", "one token: no TPOT"
    assert not meets(_stream(0.1, 0.2, 2, status="RESOURCE_EXHAUSTED"), INTERACTIVE)


def test_refusals_are_counted_by_status_and_message_with_numbers_blanked():
    failed = [_stream(0, 0, 0, "RESOURCE_EXHAUSTED", f"would start in {ms} ms") for ms in (250, 1300)]
    assert refusal_reasons([*failed, _stream(0.1, 0.2, 2)]) == {"RESOURCE_EXHAUSTED: would start in # ms": 2}


def test_the_median_of_a_window_is_interpolated_inside_its_bucket():
    before = {0.01: 1.0, 0.02: 1.0, 0.05: 1.0, INF: 1.0}
    after = {0.01: 3.0, 0.02: 7.0, 0.05: 11.0, INF: 11.0}
    # The window added 2, 4 and 4 streams: the 5th of 10 lies 3/4 into (0.01, 0.02].
    assert median_from_buckets(before, after) == pytest.approx(0.0175)
    assert median_from_buckets(after, after) is None


def test_a_window_quantile_past_the_last_finite_edge_reads_that_edge():
    before = {0.05: 0.0, 0.1: 0.0, INF: 0.0}
    after = {0.05: 90.0, 0.1: 98.0, INF: 100.0}
    assert quantile_from_buckets(before, after, 0.9) == pytest.approx(0.05)
    assert quantile_from_buckets(before, after, 0.99) == 0.1


def test_the_share_of_a_window_over_an_edge_counts_only_what_the_window_added():
    before = {0.05: 10.0, 0.1: 10.0, INF: 10.0}
    after = {0.05: 70.0, 0.1: 100.0, INF: 110.0}  # the window: 60 under 50 ms, 30 in (50, 100], 10 over
    assert share_over(before, after, 0.05) == pytest.approx(0.4)
    assert share_over(before, after, 0.1) == pytest.approx(0.1)
    assert share_over(after, after, 0.05) is None
    assert scheduler_queue(before, after)["share_over_100ms"] == pytest.approx(0.1)


def test_a_p99_of_few_streams_has_a_wide_interval_and_so_has_a_ratio_of_two():
    few = [float(ms) for ms in range(1, 101)]  # 100 streams: the p99 is one of the top few
    low, high = p99_interval_ms(few)
    assert low <= 99 <= high and high - low >= 2
    assert p99_interval_ms([]) is None
    assert ratio_interval([150.0, 180.0], [90.0, 120.0]) == pytest.approx([1.25, 2.0])
    assert ratio_interval(None, [90.0, 120.0]) is None


def test_a_run_off_the_default_settings_writes_a_file_of_its_own():
    assert default_output(Placement.SHARED, 3).name == "overload_slo.json"
    assert default_output(Placement.PINNED, 3).name == "overload_slo_pinned.json"
    assert default_output(Placement.SHARED, 1).name == "overload_slo_1procs.json"
    assert default_output(Placement.PINNED, 1).name == "overload_slo_pinned_1procs.json"
    assert default_output(Placement.SHARED, 3, 60.0).name == "overload_slo_60s.json"


def test_the_predictor_error_is_each_measured_stream_against_its_own_prediction_from_its_send():
    sent_late = SendResult("interactive", 0.0, 0.010, 0.5, "OK", ttft_s=0.110, num_tokens=4, predicted_ttft_s=0.080)
    on_time = SendResult("interactive", 0.0, 0.0, 0.5, "OK", ttft_s=0.050, num_tokens=4, predicted_ttft_s=0.090)
    unpredicted = SendResult("interactive", 0.0, 0.0, 0.5, "OK", ttft_s=0.050, num_tokens=4)
    refused = SendResult("interactive", 0.0, 0.0, 0.0, "RESOURCE_EXHAUSTED", predicted_ttft_s=0.5)
    error = predictor_error([sent_late, on_time, unpredicted, refused], INTERACTIVE)
    # |0.110 - 0.010 - 0.080| = 20 ms (the send's lag is the load generator's, not the mesh's); |0.050 - 0.090| = 40 ms
    assert error["num_streams"] == 2
    assert error["median_abs_error_ms"] == pytest.approx(20.0)
    assert error["median_abs_error_of_target"] == pytest.approx(20.0 / INTERACTIVE.ttft_ms)
    assert error["p90_abs_error_ms"] == pytest.approx(40.0)
    assert predictor_error([unpredicted], INTERACTIVE)["median_abs_error_ms"] is None


def test_each_stream_is_a_row_with_its_ttft_from_the_send_its_prediction_and_any_refusal():
    served = SendResult("batch", 1.0, 1.25, 3.0, "OK", ttft_s=2.0, num_tokens=9, predicted_ttft_s=0.5)
    refused = SendResult("interactive", 2.0, 2.0, 2.01, "RESOURCE_EXHAUSTED", message="overloaded: shedding")
    assert stream_rows("tinylm", 2.0, "slo", [served, refused]) == [
        ("tinylm", 2.0, "slo", "batch", "1.000", "OK", "1750.0", "500.0", 9, ""),
        ("tinylm", 2.0, "slo", "interactive", "2.000", "RESOURCE_EXHAUSTED", "", "", 0, "overloaded: shedding")]


def test_a_class_may_send_a_tighter_ttft_than_it_is_judged_at():
    assert parse_admit_ttft("") == {}
    assert parse_admit_ttft("interactive=60") == {"interactive": 60}
    assert parse_admit_ttft(" interactive=100 , batch=2000 ") == {"interactive": 100, "batch": 2000}
    for bad, names in (("interactive", "CLASS=MS"), ("premium=60", "CLASS=MS"), ("interactive=6.5", "whole"),
                       ("interactive=0", "> 0")):
        with pytest.raises(ValueError, match=names):
            parse_admit_ttft(bad)
    sent = gateway_pb2.GenerateRequest.FromString(templates("m", INTERACTIVE, 1, num=1, admit_ttft_ms=60)[0].body)
    assert (sent.objectives.ttft_ms, sent.objectives.tpot_ms) == (60, INTERACTIVE.tpot_ms)
    default = gateway_pb2.GenerateRequest.FromString(templates("m", BATCH, 2, num=1)[0].body)
    assert default.objectives.ttft_ms == BATCH.ttft_ms
    assert default_output(Placement.SHARED, 3, admit_ttft_ms={"interactive": 60}).name == (
        "overload_slo_admit-interactive60.json")


def _refused_at(predicted_s: float, target_ms: float, waited_s: float = 0.0) -> SendResult:
    """A stream refused by check_ttft itself, so the message read is the one the gateway sends."""
    report = PressureReport("m", {}, predicted_ttft_s={Priority.CRITICAL: predicted_s}, min_ttft_s=0.001)
    with pytest.raises(ResourceExhausted) as refused:
        check_ttft("m", Priority.CRITICAL, LatencyObjective(ttft_ms=target_ms, tpot_ms=50), report,
                   waited_s=waited_s)
    return SendResult("interactive", 0.0, 0.0, 0.0, "RESOURCE_EXHAUSTED", message=str(refused.value))


def test_streams_refused_by_a_tight_budget_are_those_predicted_within_the_judged_target():
    within, past = _refused_at(0.080, 60), _refused_at(0.250, 60)
    waited_within, waited_past = _refused_at(0.080, 60, waited_s=0.050), _refused_at(0.180, 200, waited_s=0.050)
    shed = SendResult("interactive", 0.0, 0.0, 0.0, "RESOURCE_EXHAUSTED", message="overloaded: shedding")
    served = SendResult("interactive", 0.0, 0.0, 0.5, "OK", ttft_s=0.05, num_tokens=4)
    # 80 ms, and 80 + 50 ms waited, are within 200 ms; 250 ms, and 180 + 50 ms waited, are not
    assert refused_within([within, past, waited_within, waited_past, shed, served], INTERACTIVE.ttft_ms) == 2
