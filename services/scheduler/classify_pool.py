"""Classify requests for one model version: the dynamic batcher wired to the model's workers.

The decisions (which requests, when, to which worker; deadlines; tenant fairness;
re-queue on worker loss) are `DynamicBatcher`'s; this module runs its loop:
next_batch() -> send it over the worker's Attach stream -> complete() when the
result comes back, and fails the requests the batcher gave up on.

Stages measured per request: queue wait (arrival until a worker slot was free for
it) and batch wait (slot free until its batch was dispatched).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.common import errors
from services.common.clock import Clock
from services.common.timings import StageTime
from services.scheduler import metrics
from services.scheduler.attach_types import BatchCommand, BatchItemCommand, BatchOutcome, Label, WorkerHello
from services.scheduler.config import SchedulerConfig
from services.scheduler.dynamic_batcher import Batch, BatcherConfig, DynamicBatcher, FailedItem
from services.scheduler.fair_queue import TenantContext
from services.scheduler.pressure import ModelPressure, classifier_pressure
from services.scheduler.worker_link import ModelKey, WorkerGone, WorkerLink

log = logging.getLogger(__name__)


class Timer(Protocol):
    def cancel(self) -> object: ...


CallLater = Callable[[float, Callable[[], object]], Timer]


@dataclass(eq=False)
class ClassifyJob:
    # The request's image message, passed through to the worker untouched (attach_types.BatchItemCommand).
    image: object
    top_k: int
    tenant: TenantContext
    enqueued_s: float
    deadline_s: float | None
    trace_context: dict[str, str]
    # A tensor model's request: its Tensor messages, passed through as the image is (image is None then).
    inputs: Sequence[object] = ()
    # A tensor request's shape past the batch dim and its rows on dim 0 (DynamicBatcher batches
    # one shape at a time, up to max_batch_size rows); None and 1 for an image.
    shape: Hashable = None
    rows: int = 1
    future: asyncio.Future[ClassifyOutcome] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())
    item_id: int | None = None  # the batcher's id, once queued
    slot_ready_s: float | None = None
    dispatched_s: float | None = None


@dataclass(frozen=True)
class ClassifyOutcome:
    labels: tuple[Label, ...]
    # The batch's stages at the worker, and its total.
    worker_stages: tuple[StageTime, ...]
    worker_total_us: int
    queue_wait_s: float
    batch_wait_s: float
    round_trip_s: float
    batch_size: int
    outputs: tuple[object, ...] = ()  # a tensor model's Tensor messages


def batcher_config(config: SchedulerConfig, hello: WorkerHello) -> BatcherConfig:
    max_batch_size = config.max_batch_size or hello.capacity.max_batch_size or 1
    wanted = config.preferred_batch_sizes or hello.preferred_batch_sizes  # the flag, else the model's own
    preferred = tuple(size for size in wanted if size <= max_batch_size)
    if preferred != wanted:
        log.warning("ignoring preferred batch sizes above %d for %s: %s", max_batch_size, hello.model.name,
                    sorted(set(wanted) - set(preferred)))
    return BatcherConfig(
        max_batch_size=max_batch_size,
        max_queue_delay_s=config.max_queue_delay_ms / 1000,
        preferred_batch_sizes=preferred,
        max_queue_size=config.max_queue_size,
        prefetch_lead_s=config.prefetch_lead_ms / 1000,
    )


class ClassifyPool:
    def __init__(self, model: ModelKey, hello: WorkerHello, config: SchedulerConfig,
                 clock: Clock = time.monotonic, call_later: CallLater | None = None) -> None:
        """`call_later`: runs a callback after `clock` seconds (the event loop's by default; a fake
        clock's in tests)."""
        self.model = model
        self._config = config
        self._clock = clock
        self._call_later = call_later
        self._batcher: DynamicBatcher[ClassifyJob] = DynamicBatcher(batcher_config(config, hello), clock)
        self._links: dict[str, WorkerLink] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._completions: set[asyncio.Task[None]] = set()
        self._orphaned_since_s: float | None = None
        # Since when a worker slot has been free (None: every slot busy), for the queue/batch wait split.
        self._slot_free_since_s: float | None = None
        # When the sleeping batching loop's timer fires (inf: no timer); None while it is not asleep.
        self._wake_at_s: float | None = None
        # Labelled metric children looked up once: they are updated per request.
        self._queue_depth = {p: metrics.QUEUE_DEPTH.labels(model.name, label) for p, label in metrics.PRIORITY_LABELS.items()}
        self._batch_size = metrics.BATCH_SIZE.labels(model.name)
        self._queue_time = {p: metrics.QUEUE_TIME.labels(model.name, label) for p, label in metrics.PRIORITY_LABELS.items()}

    @property
    def batching(self) -> BatcherConfig:
        """The dynamic batching in force (what KServe's ModelConfig reports)."""
        return self._batcher.config

    # -- workers -------------------------------------------------------------

    def add_worker(self, link: WorkerLink) -> None:
        capacity = link.hello.capacity
        self._batcher.add_worker(link.link_id, capacity.max_batch_size or 1,
                                 warm_batch_time_s=capacity.warm_batch_time_s or None)
        self._links[link.link_id] = link
        self._orphaned_since_s = None
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        self._changed()

    def drain_worker(self, link: WorkerLink) -> None:
        if link.link_id in self._links:
            self._batcher.drain_worker(link.link_id)
            self._changed()

    def remove_worker(self, link: WorkerLink) -> None:
        if self._links.pop(link.link_id, None) is None:
            return
        requeued = self._batcher.remove_worker(link.link_id)
        if requeued:
            log.warning("re-queued %d items of %s from worker %s", len(requeued), self.model, link.worker_id)
        self._changed()

    @property
    def workers(self) -> list[WorkerLink]:
        return list(self._links.values())

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth

    def pressure(self) -> ModelPressure:
        return classifier_pressure(self._batcher)

    # -- requests ------------------------------------------------------------

    async def submit(self, job: ClassifyJob) -> ClassifyOutcome:
        if self._batcher.num_usable_workers == 0:
            raise errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0)
        item = self._batcher.submit(job, job.tenant, deadline_s=job.deadline_s, shape=job.shape, rows=job.rows)
        job.item_id = item.item_id
        # Wake the loop only if this request moves its next decision earlier: a loop pass per
        # request was ~8% of the scheduler's CPU at 2000 classify/s.
        if self._wake_at_s is not None and self._batcher.due_after_submit_s(item) < self._wake_at_s:
            self._changed()
        return await job.future

    def cancel(self, job: ClassifyJob) -> None:
        """The caller went away: drop the job if it has not been dispatched."""
        if job.item_id is not None and self._batcher.cancel(job.item_id):
            self._changed()

    # -- batching loop -------------------------------------------------------

    def _changed(self) -> None:
        self._wake.set()
        self._wake_at_s = None

    async def _run(self) -> None:
        while True:
            now = self._clock()
            self._abandon_if_orphaned(now)
            batch = self._batcher.next_batch()
            self._fail(self._batcher.take_failed())
            if batch is not None:
                self._dispatch(batch)
                continue
            if self._batcher.has_free_worker():
                self._slot_free_since_s = self._slot_free_since_s or now
            else:
                self._slot_free_since_s = None
            for priority, gauge in self._queue_depth.items():
                gauge.set(self._batcher.queue_depth_of(priority))
            await self._sleep(self._wait_s(now))

    async def _sleep(self, timeout_s: float | None) -> None:
        """Until something changed, or `timeout_s` (a timer, cheaper than wait_for's task per wait)."""
        self._wake.clear()
        call_later = self._call_later or asyncio.get_running_loop().call_later
        timer = None if timeout_s is None else call_later(timeout_s, self._wake.set)
        self._wake_at_s = math.inf if timeout_s is None else self._clock() + timeout_s
        await self._wake.wait()
        self._wake_at_s = None
        if timer is not None:
            timer.cancel()

    def _wait_s(self, now: float) -> float | None:
        wait_s = self._batcher.time_until_ready()
        if self._orphaned_since_s is not None and self._batcher.queue_depth:
            orphan_s = max(0.0, self._orphaned_since_s + self._config.orphan_grace_ms / 1000 - now)
            wait_s = orphan_s if wait_s is None else min(wait_s, orphan_s)
        return wait_s

    def _abandon_if_orphaned(self, now: float) -> None:
        if self._batcher.num_usable_workers or not self._batcher.queue_depth:
            self._orphaned_since_s = None
            return
        if self._orphaned_since_s is None:
            self._orphaned_since_s = now
        elif now - self._orphaned_since_s >= self._config.orphan_grace_ms / 1000:
            self._batcher.abandon_queued(errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0))

    def _dispatch(self, batch: Batch[ClassifyJob]) -> None:
        now = self._clock()
        slot_free_s = min(self._slot_free_since_s or now, now)
        for item in batch.items:
            job = item.payload
            job.slot_ready_s = max(job.enqueued_s, slot_free_s)
            job.dispatched_s = now
            self._queue_time[item.tenant.priority].observe(now - item.arrival_s)
        self._batch_size.observe(len(batch.items))
        unix_offset_s = time.time() - now  # monotonic -> unix, once per batch
        command = BatchCommand(
            batch_id=batch.batch_id,
            items=tuple(
                BatchItemCommand(item_id=item.item_id, image=item.payload.image, top_k=item.payload.top_k or 1,
                                 trace_context=item.payload.trace_context,
                                 deadline_unix_s=_plus(item.deadline_s, unix_offset_s), inputs=item.payload.inputs)
                for item in batch.items),
            deadline_unix_s=_plus(batch.deadline_s, unix_offset_s),
        )
        try:
            future = self._links[batch.worker_id].execute_batch(command)
        except WorkerGone:
            # Its stream broke but it is not removed yet: remove_worker() will re-queue this batch.
            self._batcher.drain_worker(batch.worker_id)
            return
        task = asyncio.create_task(self._complete(batch, future, now))
        self._completions.add(task)
        task.add_done_callback(self._completions.discard)

    async def _complete(self, batch: Batch[ClassifyJob], future: asyncio.Future[BatchOutcome],
                        sent_s: float) -> None:
        try:
            result = await future
        except WorkerGone:
            return  # remove_worker() re-queues its items
        self._batcher.complete(batch.batch_id)
        round_trip_s = self._clock() - sent_s
        for item in batch.items:
            job = item.payload
            got = result.items.get(item.item_id)
            if got is None:
                _fail(job, errors.Internal(f"worker returned no result for item {item.item_id}"))
            elif got.error is not None:
                _fail(job, got.error)
            elif not job.future.done():
                slot_ready_s = job.slot_ready_s or sent_s
                job.future.set_result(
                    ClassifyOutcome(
                        labels=got.labels,
                        worker_stages=result.worker_stages,
                        worker_total_us=result.worker_total_us,
                        queue_wait_s=slot_ready_s - job.enqueued_s,
                        batch_wait_s=sent_s - slot_ready_s,
                        round_trip_s=round_trip_s,
                        batch_size=len(batch.items),
                        outputs=got.outputs,
                    )
                )
        self._changed()

    def _fail(self, failed: list[FailedItem[ClassifyJob]]) -> None:
        for entry in failed:
            _fail(entry.item.payload, entry.error)


def _plus(time_s: float | None, offset_s: float) -> float | None:
    return None if time_s is None else time_s + offset_s


def _fail(job: ClassifyJob, exc: errors.InfermeshError) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
