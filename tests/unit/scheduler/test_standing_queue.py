from __future__ import annotations

import pytest

from services.common.errors import DeadlineExceeded
from services.scheduler.standing_queue import StandingQueue, StandingQueueConfig

from .conftest import make_batcher, tenant


def test_a_queue_stands_when_its_shortest_wait_over_an_interval_exceeds_the_target():
    queue = StandingQueue(StandingQueueConfig(target_s=0.005, interval_s=0.1), start_s=0.0)
    for t in range(1, 11):  # every item waited 40 ms; one batch takes 20 ms
        queue.on_dispatch(0.040, batch_time_s=0.020, now_s=t * 0.01)
    assert queue.standing
    queue.on_dispatch(0.001, batch_time_s=0.020, now_s=0.15)  # one short wait in the next interval
    queue.on_dispatch(0.040, batch_time_s=0.020, now_s=0.21)
    assert not queue.standing


def test_waits_within_one_batch_time_are_the_good_queue():
    queue = StandingQueue(StandingQueueConfig(target_s=0.005, interval_s=0.1), start_s=0.0)
    for t in range(1, 21):
        queue.on_dispatch(0.020, batch_time_s=0.020, now_s=t * 0.01)
    assert not queue.standing


def test_draining_the_queue_ends_standing_at_once():
    queue = StandingQueue(StandingQueueConfig(interval_s=0.1), start_s=0.0)
    queue.on_dispatch(1.0, batch_time_s=0.0, now_s=0.2)
    assert queue.standing
    queue.on_empty(now_s=0.25)
    assert not queue.standing


@pytest.mark.parametrize("over", [dict(target_s=-1.0), dict(interval_s=0.0), dict(aging_s=0.0)])
def test_config_is_checked(over):
    with pytest.raises(ValueError):
        StandingQueueConfig(**over)


def overload(clock, batcher, *, num_ticks: int, per_tick: int, deadline_s: float | None) -> tuple[list[float], list]:
    """One worker finishing a batch of 8 every 10 ms; `per_tick` requests arrive every 1 ms."""
    waits, failed, running = [], [], None
    for _ in range(num_ticks):
        for _arrival in range(per_tick):
            try:
                batcher.submit(clock(), tenant(), deadline_s=None if deadline_s is None else clock() + deadline_s)
            except DeadlineExceeded:
                pass  # refused up front: cannot finish behind the queue
        if running is not None and running[0] <= clock() + 1e-9:
            batcher.complete(running[1].batch_id, compute_s=0.010)
            running = None
        if running is None and (batch := batcher.next_batch()) is not None:
            running = (clock() + 0.010, batch)
            waits += [clock() - item.payload for item in batch.items]
        failed += batcher.take_failed()
        clock.advance(0.001)
    return waits, failed


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def test_a_standing_queue_serves_the_newest_first_so_they_make_their_deadlines(clock):
    config = StandingQueueConfig(target_s=0.005, interval_s=0.05, aging_s=10.0)
    batcher = make_batcher(clock, max_batches_per_worker=1, max_queue_size=100_000, standing_queue=config)
    # Twice what the worker serves, 150 ms deadlines, 3 s.
    waits, failed = overload(clock, batcher, num_ticks=3000, per_tick=2, deadline_s=0.150)
    assert batcher.standing
    late = waits[len(waits) // 2:]
    assert p90(late) < 0.03  # nine in ten served within 30 ms of arriving
    assert all(isinstance(f.error, DeadlineExceeded) for f in failed) and failed  # the oldest ran out of time


def test_served_oldest_first_the_same_overload_waits_near_the_deadline(clock):
    batcher = make_batcher(clock, max_batches_per_worker=1, max_queue_size=100_000, standing_queue=None)
    waits, _ = overload(clock, batcher, num_ticks=3000, per_tick=2, deadline_s=0.150)
    assert p90(waits[len(waits) // 2:]) > 0.1


def test_no_request_starves_behind_newer_ones(clock):
    """Closed loop, 48 outstanding (a standing queue of 40 behind one batch of 8): under pure LIFO
    the oldest would wait forever behind the resubmitted ones."""
    config = StandingQueueConfig(target_s=0.005, interval_s=0.05, aging_s=0.2)
    batcher = make_batcher(clock, max_batches_per_worker=1, max_queue_size=100_000, standing_queue=config)
    for _ in range(48):
        batcher.submit(clock(), tenant(), deadline_s=None)
    waits, running = [], None
    for _ in range(3000):
        if running is not None and running[0] <= clock() + 1e-9:
            batcher.complete(running[1].batch_id, compute_s=0.010)
            for _done in running[1].items:
                batcher.submit(clock(), tenant(), deadline_s=None)
            running = None
        if running is None and (batch := batcher.next_batch()) is not None:
            running = (clock() + 0.010, batch)
            waits += [clock() - item.payload for item in batch.items]
        clock.advance(0.001)
    assert batcher.standing
    assert max(waits) < 0.2 + 0.02  # aged items go first
    assert not batcher.take_failed()
