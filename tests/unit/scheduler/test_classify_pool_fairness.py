"""The classify pool's own loop keeps tenant fairness while its queue stands (issue 41).

test_standing_fairness.py drives the DynamicBatcher alone; this drives the ClassifyPool above it,
with its batching loop, its wake-ups and timers, its just-in-time prefetch and a fake worker on
the other end of a real WorkerLink, all on one fake clock: the scenario of bench_scheduler's
fairness benchmark (batches of 8 taking 20 ms, 1 s deadlines, a light tenant at half its share,
a heavy one at 5x its share).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from services.common import errors
from services.scheduler.attach_types import (
    BatchCommand,
    BatchOutcome,
    ItemOutcome,
    Label,
    ModelKey,
    ModelKind,
    WorkerCapacity,
    WorkerHello,
)
from services.scheduler.classify_pool import ClassifyJob, ClassifyPool
from services.scheduler.config import SchedulerConfig
from services.scheduler.worker_link import WorkerLink

from .conftest import FakeClock, arrivals_per_tick, tenant

MODEL = ModelKey("toy-classifier", "1")
BATCH_SIZE = 8
BATCH_S = 0.020
TICK_S = 0.001
LIGHT_PER_S = 100.0  # half of its share of the 400/s capacity
HEAVY_PER_S = 1000.0  # five times its share
DEADLINE_S = 1.0


class FakeTimers:
    """`loop.call_later` on the fake clock: callbacks run when `advance` carries the clock past them."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._due: list[tuple[float, int, asyncio.TimerHandle | _Timer]] = []
        self._order = itertools.count()

    def call_later(self, delay_s: float, callback: Callable[[], object]) -> _Timer:
        timer = _Timer(callback)
        heapq.heappush(self._due, (self.clock() + delay_s, next(self._order), timer))
        return timer

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        while self._due and self._due[0][0] <= self.clock() + 1e-9:
            _, _, timer = heapq.heappop(self._due)
            timer.fire()


class _Timer:
    def __init__(self, callback: Callable[[], object]) -> None:
        self._callback: Callable[[], object] | None = callback

    def cancel(self) -> None:
        self._callback = None

    def fire(self) -> None:
        if self._callback is not None:
            self._callback()


class FakeClassifier:
    """Runs each batch the link carries after the one before it, BATCH_S each, on the fake clock."""

    def __init__(self, link: WorkerLink, timers: FakeTimers) -> None:
        self.link = link
        self._timers = timers
        self._busy_until_s = timers.clock()
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while (command := await self.link.next_command()) is not None:
            if isinstance(command, BatchCommand):
                now = self._timers.clock()
                self._busy_until_s = max(now, self._busy_until_s) + BATCH_S
                outcome = BatchOutcome({item.item_id: ItemOutcome(labels=(Label("7", 7, 1.0),))
                                        for item in command.items}, (), int(BATCH_S * 1e6))
                self._timers.call_later(self._busy_until_s - now,
                                        lambda b=command.batch_id, o=outcome: self.link.on_result(b, o))


async def _settle(turns: int = 8) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


async def test_light_tenant_keeps_its_share_and_delay_bound_through_the_pool_while_the_flood_stands():
    clock = FakeClock()
    timers = FakeTimers(clock)
    hello = WorkerHello("w1", MODEL, ModelKind.CLASSIFIER, WorkerCapacity(max_batch_size=BATCH_SIZE), 1)
    pool = ClassifyPool(MODEL, hello, SchedulerConfig(), clock=clock, call_later=timers.call_later)
    link = WorkerLink(hello)
    pool.add_worker(link)
    FakeClassifier(link, timers)
    jobs: dict[str, list[tuple[ClassifyJob, asyncio.Task]]] = {"light": [], "heavy": []}
    duration_s = 2.0  # the flood's backlog ages past aging_s (0.5 s) from ~0.8 s on
    light_arrivals = arrivals_per_tick(LIGHT_PER_S, duration_s, TICK_S, seed=1)
    heavy_arrivals = arrivals_per_tick(HEAVY_PER_S, duration_s, TICK_S, seed=2)
    for num_light, num_heavy in zip(light_arrivals, heavy_arrivals, strict=True):
        for who in ["light"] * num_light + ["heavy"] * num_heavy:
            job = ClassifyJob(image=None, top_k=1, tenant=tenant(who), enqueued_s=clock(),
                              deadline_s=clock() + DEADLINE_S, trace_context={})
            jobs[who].append((job, asyncio.create_task(pool.submit(job))))
        await _settle()
        timers.advance(TICK_S)
        await _settle()
    light, light_failed = _outcomes(jobs["light"])
    heavy, heavy_failed = _outcomes(jobs["heavy"])
    heavy_delays_s = [job.dispatched_s - job.enqueued_s for job in heavy]
    # The queue stood: newest-first served some heavy requests fresh behind a backlog, and that
    # backlog aged past aging_s; the rest of the flood ran into its deadline.
    assert min(heavy_delays_s[len(heavy_delays_s) // 4:]) < 0.05 and max(heavy_delays_s) > 0.5
    assert heavy_failed and all(isinstance(e, errors.DeadlineExceeded) for e in heavy_failed)
    assert not light_failed
    # Every light request went out within the bound below (those sent just before the end too).
    end_s = clock()
    late = [job for job, _ in jobs["light"] if job.dispatched_s is None and end_s - job.enqueued_s > 2 * BATCH_S]
    assert not late
    assert len(light) / (len(light) + len(heavy)) >= 0.24  # a quarter of what the worker ran
    delays_s = [job.dispatched_s - job.enqueued_s for job, _ in jobs["light"] if job.dispatched_s is not None]
    # Non-preemptive: at worst the running batch, and the next (DRR gives it half of each batch).
    assert max(delays_s) <= 2 * BATCH_S + TICK_S
    link.close()
    for task in asyncio.all_tasks() - {asyncio.current_task()}:
        task.cancel()  # the pool's loop, the worker, the callers still waiting
    await _settle()


def _outcomes(calls: list[tuple[ClassifyJob, asyncio.Task]]) -> tuple[list[ClassifyJob], list[BaseException]]:
    """The jobs answered, and the errors of those failed, of the calls that have finished."""
    done = [(job, task) for job, task in calls if task.done()]
    return ([job for job, task in done if task.exception() is None],
            [exc for _, task in done if (exc := task.exception()) is not None])
