"""The step time a StepScheduler learns from its steps' wall clock: a freeze is not "one step alone",
and an idle worker keeps what it knew (step_scheduler.py, latency_predictor.py)."""

from __future__ import annotations

import pytest

from services.scheduler.fair_queue import Priority

from .conftest import FakeClock, FakePagedWorker, make_requests, make_scheduler, tenant


def _step(scheduler, worker: FakePagedWorker, clock: FakeClock, took_s: float) -> None:
    plan = scheduler.schedule()
    assert plan.has_work()
    sampled = worker.run(plan)
    clock.advance(took_s)
    scheduler.update_from_output(plan, sampled)


def _steady_scheduler(clock: FakeClock, num_steps: int = 40):
    scheduler = make_scheduler(clock, num_blocks=512, max_seq_len=512)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 4, prompt_len=4, max_tokens=400)
    for _ in range(num_steps):
        _step(scheduler, worker, clock, 0.02)
    return scheduler, worker


def test_a_five_second_freeze_does_not_become_one_step_alone(clock):
    scheduler, worker = _steady_scheduler(clock)
    _step(scheduler, worker, clock, 5.0)  # the worker was SIGSTOPped mid-step
    # Unclipped, the mean step alone moved by a second (0.2 x 5 s): admission refused every TPOT target.
    assert scheduler.latency.min_ttft_s() < 0.025
    assert scheduler.step_time_s < 0.1
    for _ in range(5):
        _step(scheduler, worker, clock, 0.02)
    assert scheduler.step_time_s == pytest.approx(0.02, rel=0.15)
    assert scheduler.predicted_latency(Priority.STANDARD).tpot_s == pytest.approx(0.02, rel=0.15)


def test_a_sustained_slowdown_is_learned(clock):
    scheduler, worker = _steady_scheduler(clock)
    for _ in range(20):
        _step(scheduler, worker, clock, 0.06)
    assert scheduler.step_time_s == pytest.approx(0.06, rel=0.1)
    assert scheduler.predicted_latency(Priority.STANDARD).tpot_s == pytest.approx(0.06, rel=0.15)


def test_an_idle_worker_keeps_its_estimate_and_idle_time_is_no_step(clock):
    scheduler, worker = _steady_scheduler(clock)
    before = (scheduler.step_time_s, scheduler.latency.model.cost)
    clock.advance(60.0)  # no step for a minute
    assert (scheduler.step_time_s, scheduler.latency.model.cost) == before
    _step(scheduler, worker, clock, 0.02)  # the next step's time starts when it is planned
    assert scheduler.step_time_s == pytest.approx(0.02, rel=0.05)


def test_the_steps_of_one_frozen_command_count_as_one_freeze(clock):
    scheduler, worker = _steady_scheduler(clock, num_steps=200)  # the fit's memory
    for _ in range(8):  # the step loop passes each step's share of a command's time
        plan = scheduler.schedule()
        sampled = worker.run(plan)
        scheduler.update_from_output(plan, sampled, 5.0 / 8)
    assert scheduler.latency.min_ttft_s() < 0.025
    for _ in range(15):  # the mean step time (an EWMA of 0.2) took 8 steps at 3x: it is back in 15
        _step(scheduler, worker, clock, 0.02)
    assert scheduler.step_time_s == pytest.approx(0.02, rel=0.15)


def _critical_fills_every_slot(clock: FakeClock, *, num_waiting: int):
    """8 slots: 8 long critical streams running (and `num_waiting` more queued), 60 steps of 20 ms."""
    scheduler = make_scheduler(clock, num_blocks=512, max_seq_len=512)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 8 + num_waiting, prompt_len=4, max_tokens=400, who=tenant("vip", Priority.CRITICAL))
    for _ in range(60):
        _step(scheduler, worker, clock, 0.02)
    return scheduler


def test_a_lower_class_behind_a_higher_one_that_fills_every_slot_is_predicted_starved(clock):
    scheduler = _critical_fills_every_slot(clock, num_waiting=4)
    critical = scheduler.predicted_latency(Priority.CRITICAL).ttft_s
    sheddable = scheduler.predicted_latency(Priority.SHEDDABLE).ttft_s
    # The same slots and queue ahead of both, but the critical arrivals meanwhile go first: the sheddable
    # stream's wait is many times the critical one's (before: the same, ~0.1 s of a wait of seconds).
    assert sheddable > 10 * critical


def test_a_lower_class_with_a_free_slot_is_predicted_as_the_higher_one(clock):
    scheduler = make_scheduler(clock, num_blocks=512, max_seq_len=512)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 6, prompt_len=4, max_tokens=400, who=tenant("vip", Priority.CRITICAL))
    for _ in range(60):
        _step(scheduler, worker, clock, 0.02)
    assert scheduler.predicted_latency(Priority.SHEDDABLE) == scheduler.predicted_latency(Priority.CRITICAL)



def _staggered(clock: FakeClock, num_running: int):
    """8 slots, `num_running` critical streams ending 40 steps apart (max_tokens 100, 140, ...), 20 steps of 20 ms."""
    scheduler = make_scheduler(clock, num_blocks=512, max_seq_len=512)
    worker = FakePagedWorker(4)
    for i in range(num_running):
        make_requests(scheduler, 1, prompt_len=4, max_tokens=100 + 40 * i, first_id=i + 1,
                      who=tenant("vip", Priority.CRITICAL))
    for _ in range(20):
        _step(scheduler, worker, clock, 0.02)
    return scheduler


def test_a_stream_queued_ahead_costs_little_while_slots_are_free_and_a_slot_turnover_once_they_are_full(clock):
    """ttft_per_queued_s, the slope a gateway adds per stream it admitted since the last report."""
    free_slope = _staggered(clock, 2).ttft_per_queued_s(Priority.CRITICAL)
    full = _staggered(clock, 8)
    full_slope = full.ttft_per_queued_s(Priority.CRITICAL)
    # Six free slots of eight: four typical streams ahead still leave it one. Every slot held, ending 40 steps
    # apart: each one ahead takes the next slot to free, so it waits ~40 steps (0.8 s) more per stream ahead.
    assert free_slope < 0.005
    assert full_slope > 0.4
    span = 4
    expected = (full.predicted_latency(Priority.CRITICAL, num_queued_ahead=span).ttft_s
                - full.predicted_latency(Priority.CRITICAL).ttft_s) / span
    assert full_slope == pytest.approx(expected)
    # The lower class's wait for the same slots stretches with the higher class's share of them.
    assert full.ttft_per_queued_s(Priority.SHEDDABLE) > full_slope
