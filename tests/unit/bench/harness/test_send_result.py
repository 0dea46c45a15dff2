"""bench/harness/send_result.py: the load engine's results merged, windowed, and the generator's lag."""

from __future__ import annotations

import pytest

from bench.harness.send_result import in_window, lag_summary, merge_results
from tests.unit.bench.conftest import make_send_result


def test_merge_results_orders_every_processs_results_by_scheduled_time():
    first = [make_send_result(0.0), make_send_result(0.2)]
    second = [make_send_result(0.1), make_send_result(0.3)]
    merged = merge_results([first, second])
    assert [r.scheduled_s for r in merged] == [0.0, 0.1, 0.2, 0.3]


def test_in_window_keeps_what_was_scheduled_in_the_half_open_window():
    results = [make_send_result(t) for t in (0.5, 1.0, 1.5, 3.0)]
    assert [r.scheduled_s for r in in_window(results, 1.0, 3.0)] == [1.0, 1.5]


def test_lag_summary_flags_a_generator_whose_p99_lag_exceeds_the_threshold():
    on_time = [make_send_result(i / 100, lag_s=0.001) for i in range(100)]
    assert not lag_summary(on_time, threshold_ms=5.0).fell_behind
    late = on_time[:97] + [make_send_result(1.0, lag_s=0.02) for _ in range(3)]
    summary = lag_summary(late, threshold_ms=5.0)
    assert summary.fell_behind
    assert summary.p99_ms == pytest.approx(20.0)
    assert summary.p50_ms == pytest.approx(1.0)
