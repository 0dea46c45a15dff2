"""Classify requests for one model version: queue, form batches, dispatch to its workers.

Stages measured per request: queue wait (enqueued until a worker slot was free
for it) and batch wait (slot free until its batch was dispatched).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.common import errors
from services.common.status import ERROR_BY_STATUS, STATUS_BY_NUMBER
from services.scheduler.config import SchedulerConfig
from services.scheduler.worker_link import ModelKey, WorkerGone, WorkerLink

log = logging.getLogger(__name__)

BATCHES_IN_FLIGHT_PER_WORKER = 2  # one running plus one prefetched, so a worker never idles
ORPHAN_GRACE_S = 2.0  # queued work waits this long for a worker to (re)attach


@dataclass(eq=False)
class ClassifyJob:
    request: gateway_pb2.ClassifyRequest
    tenant: scheduler_pb2.TenantContext
    enqueued_s: float
    deadline_s: float | None
    trace_context: dict[str, str]
    item_id: int = field(default_factory=WorkerLink.next_id)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    slot_ready_s: float | None = None
    dispatched_s: float | None = None


@dataclass(frozen=True)
class ClassifyOutcome:
    labels: list
    worker_timings: object  # common_pb2.Timings of the batch
    queue_wait_s: float
    batch_wait_s: float
    round_trip_s: float
    batch_size: int


class ClassifyPool:
    def __init__(self, model: ModelKey, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self._config = config
        self._clock = clock
        self._queue: deque[ClassifyJob] = deque()
        self._workers: list[WorkerLink] = []
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._orphaned_since_s: float | None = None
        self.batch_time_s = 0.0  # EWMA of round-trip batch time, for early deadline rejection

    # -- workers -------------------------------------------------------------

    def add_worker(self, link: WorkerLink) -> None:
        self._workers.append(link)
        self._orphaned_since_s = None
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        self._changed.set()

    def remove_worker(self, link: WorkerLink) -> None:
        if link in self._workers:
            self._workers.remove(link)
        if not self._workers:
            self._orphaned_since_s = self._clock()
        self._changed.set()

    @property
    def workers(self) -> list[WorkerLink]:
        return list(self._workers)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def max_batch_size(self) -> int:
        sizes = [w.hello.capacity.max_batch_size or 1 for w in self._workers] or [1]
        worker_max = min(sizes)
        return min(worker_max, self._config.max_batch_size) if self._config.max_batch_size else worker_max

    # -- requests ------------------------------------------------------------

    async def submit(self, job: ClassifyJob) -> ClassifyOutcome:
        if not any(w.usable for w in self._workers):
            raise errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0)
        if len(self._queue) >= self._config.max_queue_size:
            raise errors.ResourceExhausted(
                f"queue for model {self.model} is full ({self._config.max_queue_size} requests)", retry_after_s=0.1
            )
        if job.deadline_s is not None and job.deadline_s - job.enqueued_s < self.batch_time_s:
            raise errors.DeadlineExceeded(
                f"deadline of {1000 * (job.deadline_s - job.enqueued_s):.1f} ms is shorter than the "
                f"{1000 * self.batch_time_s:.1f} ms a batch of {self.model} takes"
            )
        self._queue.append(job)
        self._changed.set()
        return await job.future

    def cancel(self, job: ClassifyJob) -> None:
        """The caller went away: drop the job if it has not been dispatched."""
        if job in self._queue:
            self._queue.remove(job)

    # -- batching loop -------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._drop_expired()
            self._fail_if_orphaned()
            worker = self._free_worker()
            wait_s = None
            if worker is not None and self._queue:
                now = self._clock()
                for job in self._queue:
                    job.slot_ready_s = job.slot_ready_s or now
                wait_s = self._time_until_ready(now)
                if wait_s <= 0:
                    self._dispatch(worker, self._take_batch())
                    continue
            if self._orphaned_since_s is not None and self._queue:
                wait_s = min(wait_s or ORPHAN_GRACE_S, ORPHAN_GRACE_S)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=wait_s)
            except TimeoutError:
                pass

    def _time_until_ready(self, now: float) -> float:
        if len(self._queue) >= self.max_batch_size() or len(self._queue) in self._config.preferred_batch_sizes:
            return 0.0
        oldest = self._queue[0]
        until_delay = oldest.enqueued_s + self._config.max_queue_delay_ms / 1000 - now
        if oldest.deadline_s is not None:
            # Never hold a request past the point where its deadline can still be met.
            until_delay = min(until_delay, oldest.deadline_s - self.batch_time_s - now)
        return max(0.0, until_delay)

    def _free_worker(self) -> WorkerLink | None:
        usable = [w for w in self._workers if w.usable and w.num_in_flight < BATCHES_IN_FLIGHT_PER_WORKER]
        return min(usable, key=lambda w: w.num_in_flight, default=None)

    def _take_batch(self) -> list[ClassifyJob]:
        size = min(len(self._queue), self.max_batch_size())
        return [self._queue.popleft() for _ in range(size)]

    def _drop_expired(self) -> None:
        now = self._clock()
        for job in [j for j in self._queue if j.deadline_s is not None and j.deadline_s <= now]:
            self._queue.remove(job)
            _fail(job, errors.DeadlineExceeded(f"deadline passed after {1000 * (now - job.enqueued_s):.1f} ms in queue"))

    def _fail_if_orphaned(self) -> None:
        if self._orphaned_since_s is None or self._clock() - self._orphaned_since_s < ORPHAN_GRACE_S:
            return
        while self._queue:
            _fail(self._queue.popleft(), errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0))

    def _dispatch(self, worker: WorkerLink, jobs: list[ClassifyJob]) -> None:
        now = self._clock()
        for job in jobs:
            job.dispatched_s = now
        batch = scheduler_pb2.ExecuteBatch(
            batch_id=WorkerLink.next_id(),
            items=[
                scheduler_pb2.BatchItem(
                    item_id=job.item_id,
                    image=job.request.image,
                    top_k=job.request.top_k or 1,
                    trace_context=job.trace_context,
                )
                for job in jobs
            ],
        )
        future = worker.execute_batch(batch)
        asyncio.create_task(self._complete(jobs, future, now))

    async def _complete(self, jobs: list[ClassifyJob], future: asyncio.Future, sent_s: float) -> None:
        try:
            result: scheduler_pb2.BatchResult = await future
        except WorkerGone as exc:
            log.warning("re-queueing %d items of %s: %s", len(jobs), self.model, exc.message)
            for job in reversed(jobs):
                job.dispatched_s = None
                self._queue.appendleft(job)
            self._changed.set()
            return
        round_trip_s = self._clock() - sent_s
        self.batch_time_s = round_trip_s if not self.batch_time_s else 0.8 * self.batch_time_s + 0.2 * round_trip_s
        by_id = {item.item_id: item for item in result.items}
        for job in jobs:
            item = by_id.get(job.item_id)
            if item is None:
                _fail(job, errors.Internal(f"worker returned no result for item {job.item_id}"))
            elif item.HasField("error") and item.error.code != 0:
                _fail(job, _item_error(item.error))
            elif not job.future.done():
                job.future.set_result(
                    ClassifyOutcome(
                        labels=list(item.labels),
                        worker_timings=result.timings,
                        queue_wait_s=(job.slot_ready_s or sent_s) - job.enqueued_s,
                        batch_wait_s=sent_s - (job.slot_ready_s or sent_s),
                        round_trip_s=round_trip_s,
                        batch_size=len(jobs),
                    )
                )
        self._changed.set()


def _item_error(error: scheduler_pb2.ItemError) -> errors.InfermeshError:
    code = STATUS_BY_NUMBER.get(error.code)
    cls = ERROR_BY_STATUS.get(code, errors.Internal)
    return cls(error.message)


def _fail(job: ClassifyJob, exc: errors.InfermeshError) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
