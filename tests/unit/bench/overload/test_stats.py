"""bench/overload/stats.py: the overload benchmark's figures: goodput, coverage, summaries per tenant."""

from __future__ import annotations

import math

import pytest

from bench.harness.stats import ratio
from bench.overload.stats import by_tenant, coverage, goodput_per_s, summarize, summarize_streams
from tests.unit.bench.conftest import make_send_result


def test_goodput_counts_successes_within_the_deadline_from_the_scheduled_time():
    results = [
        make_send_result(latency_s=0.05),
        make_send_result(latency_s=0.1),  # exactly at the deadline: good
        make_send_result(latency_s=0.101),  # ok, but late
        make_send_result(latency_s=0.01, status="RESOURCE_EXHAUSTED"),
        make_send_result(latency_s=0.05, lag_s=0.04),  # late generator: still inside from the scheduled time
    ]
    assert goodput_per_s(results, deadline_s=0.1, window_s=2.0) == 1.5
    with pytest.raises(ValueError, match="window_s must be > 0, got 0"):
        goodput_per_s(results, 0.1, 0)


def test_coverage_around_the_median_and_in_the_tail_uses_those_requests_only():
    # 100 requests: the fast 99 are fully covered by stages, the slowest one only 20%.
    results = [make_send_result(latency_s=0.010 + i * 1e-5, leaf_stage_us=round((0.010 + i * 1e-5) * 1e6)) for i in range(99)]
    results.append(make_send_result(latency_s=1.0, leaf_stage_us=200_000))
    assert coverage(results, 0.5) == pytest.approx(1.0, abs=1e-3)
    # The tail band (ranks from 97% up) sums 2 covered requests with the uncovered one.
    tail = coverage(results, 0.99)
    assert tail == pytest.approx((0.01097 + 0.01098 + 0.2) / (0.01097 + 0.01098 + 1.0), rel=1e-3)


def test_coverage_ignores_failures_and_is_nan_without_successes():
    assert math.isnan(coverage([make_send_result(status="UNAVAILABLE", leaf_stage_us=5)], 0.5))
    mixed = [make_send_result(latency_s=0.01, leaf_stage_us=5000), make_send_result(latency_s=0.01, status="UNAVAILABLE")]
    assert coverage(mixed, 0.5) == pytest.approx(0.5)


def test_summarize_counts_errors_by_code_and_takes_latency_of_successes_only():
    results = [make_send_result(latency_s=0.01 * (i + 1)) for i in range(10)]
    results += [make_send_result(status="DEADLINE_EXCEEDED", latency_s=5.0)] * 2 + [make_send_result(status="UNAVAILABLE")]
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
    streams = [make_send_result(latency_s=0.5 + i / 100, ttft_s=0.02 + i / 1000, num_tokens=10) for i in range(10)]
    streams.append(make_send_result(status="DEADLINE_EXCEEDED", latency_s=5.0))
    summary = summarize_streams(streams, window_s=5.0, lag_threshold_ms=5.0)
    assert summary["num_streams"] == 11 and summary["num_ok"] == 10
    assert summary["ttft_p99_ms"] == pytest.approx(29.0)
    assert summary["e2e_p50_ms"] == pytest.approx(540.0)
    assert summary["output_tokens_per_s"] == 20.0


def test_by_tenant_groups_and_ratio_handles_missing_values():
    groups = by_tenant([make_send_result(tenant="a"), make_send_result(tenant="b"), make_send_result(tenant="a")])
    assert {k: len(v) for k, v in groups.items()} == {"a": 2, "b": 1}
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))
