"""warm_batch_time_us: the warm-up batch runs twice and only the second, warm run is timed."""

from __future__ import annotations

from services.worker.runtime import warm_batch_time_us
from tools.testbed.fake_clock import FakeClock


def test_only_the_second_run_is_timed():
    clock = FakeClock()
    run_times_s = [3.0, 0.002]  # cold (compilation, lazy init), then warm

    def run_batch() -> None:
        clock.advance(run_times_s.pop(0))

    assert warm_batch_time_us(run_batch, clock) == 2000
    assert run_times_s == []


def test_a_run_too_quick_to_measure_still_reads_as_known():
    assert warm_batch_time_us(lambda: None, FakeClock()) == 1  # 0 would mean "unknown" on the wire
