"""bench_slo's judging of streams and its reading of the gateway's TTFT error histogram."""

from __future__ import annotations

import pytest

from bench.harness.send_result import SendResult
from bench.overload.bench_slo import INTERACTIVE, median_from_buckets, meets, misses, refusal_reasons

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
