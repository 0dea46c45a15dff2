"""Dynamic batching of one fixed-shape model's requests over its workers.

A batch goes out when a worker has a free slot (one batch running plus
`max_batches_per_worker - 1` prefetched, so a worker never idles between
batches) and one of these holds:
  * the worker is idle: waiting for a fuller batch would only leave it idle longer
    (what arrives meanwhile forms the next batch, while this one runs);
  * the queue fills a batch of the worker's maximum size, or a preferred size;
  * the oldest request has waited `max_queue_delay_s`;
  * waiting any longer would make the most urgent request miss its deadline,
    given the measured time of a full batch.
A batch holds one shape: a tensor model's requests are stacked on dim 0 only with
requests of the same shape past it, up to the worker's max batch size in rows (an image
model's all share one); one of another shape is put back with its tenant's credit and
leads a later batch. The queue is per tenant (fair_queue.py), bounded (full: ResourceExhausted at
once). When it stops draining (standing_queue.py: its oldest wait stays above
target for an interval), it serves the newest items first, which have the most
time left, so those it serves still finish in time while the oldest run into
their deadlines; an item that waited `aging_s` is served before newer ones, so
none starves. It goes back to oldest-first once it drains. A request whose deadline cannot be met behind the queue ahead of it is
rejected at submit (DeadlineExceeded); one that expires while queued is dropped
before dispatch and never reaches a worker. When a worker is lost, its batches'
items go back to the front of the queue with their original arrival and deadline.

Batch times are learned per batch size (EWMA) from `complete()`. Before a size is measured, a
worker's warm-up time for its max batch size (declared when it attaches) stands for that size, so
one cold first batch, timed from dispatch to result, is not scaled linearly up to a full batch: an
unmeasured size borrows the nearest larger known time and is extrapolated only above all of them.
A worker's first batch pays its one-time costs (threads, lazy imports, the first decode of a format),
so it counts at most its worker's warm full-batch time: a batch no larger takes no longer once warm.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.common.clock import Clock
from services.common.errors import DeadlineExceeded, InfermeshError, ResourceExhausted, Unavailable
from services.scheduler.fair_queue import FairQueue, Priority, TenantContext
from services.scheduler.standing_queue import StandingQueue, StandingQueueConfig

P = TypeVar("P")


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int
    max_queue_delay_s: float
    # Sizes worth sending at once without waiting for more (Triton's preferred_batch_size).
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    # Batch time assumed before any batch was measured.
    initial_batch_time_s: float = 0.05
    batch_time_ewma_alpha: float = 0.2
    # Batches one worker holds at once: one running, the rest prefetched.
    max_batches_per_worker: int = 2
    # A prefetched batch goes out only once the worker's running batch is expected to end within
    # this many seconds (None: as soon as a slot is free). Forming it late lets what arrives
    # meanwhile (another tenant's request, a more urgent one) into it, while the worker still
    # finds its next batch waiting; a wrong estimate costs at most one round trip of idling.
    prefetch_lead_s: float | None = None
    # An idle worker takes what is queued at once rather than wait for a fuller batch (what arrives
    # meanwhile forms the next one). False: Triton's rule, every partial batch waits max_queue_delay_s.
    dispatch_to_idle_worker: bool = True
    # Adaptive LIFO and a wait limit while the queue stands (None: always oldest-first, no limit).
    standing_queue: StandingQueueConfig | None = dataclasses.field(default_factory=StandingQueueConfig)
    # Dispatches of one item (first try + re-queues after worker loss) before it fails UNAVAILABLE.
    max_attempts: int = 3
    # Retry hint when no worker is attached.
    no_worker_retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_queue_size", "max_batches_per_worker", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_delay_s < 0:
            raise ValueError(f"max_queue_delay_s must be >= 0, got {self.max_queue_delay_s}")
        bad = [s for s in self.preferred_batch_sizes if not 1 <= s <= self.max_batch_size]
        if bad:
            raise ValueError(f"preferred_batch_sizes must be in [1, {self.max_batch_size}], got {bad}")
        if self.prefetch_lead_s is not None and self.prefetch_lead_s < 0:
            raise ValueError(f"prefetch_lead_s must be >= 0, got {self.prefetch_lead_s}")
        if self.initial_batch_time_s <= 0:
            raise ValueError(f"initial_batch_time_s must be > 0, got {self.initial_batch_time_s}")
        if not 0 < self.batch_time_ewma_alpha <= 1:
            raise ValueError(f"batch_time_ewma_alpha must be in (0, 1], got {self.batch_time_ewma_alpha}")


@dataclass(frozen=True)
class QueuedItem(Generic[P]):
    item_id: int
    payload: P
    tenant: TenantContext
    # Monotonic seconds (the batcher's clock); kept across re-queues.
    arrival_s: float
    deadline_s: float | None
    num_attempts: int = 0
    # A tensor request's shape past the batch dim (None: a fixed-shape model's image), and its rows
    # on dim 0: a batch holds one shape and at most the worker's max batch size in rows.
    shape: Hashable = None
    rows: int = 1


@dataclass(frozen=True)
class Batch(Generic[P]):
    batch_id: int
    worker_id: str
    items: tuple[QueuedItem[P], ...]
    dispatched_at_s: float

    @property
    def deadline_s(self) -> float | None:
        """Latest useful completion (ExecuteBatch.deadline): the loosest item deadline, None if any has none."""
        latest_s = -math.inf
        for item in self.items:
            if item.deadline_s is None:
                return None
            latest_s = max(latest_s, item.deadline_s)
        return latest_s


@dataclass(frozen=True)
class FailedItem(Generic[P]):
    """A queued item the batcher gave up on; fail its request with `error`."""

    item: QueuedItem[P]
    error: InfermeshError


@dataclass
class _Worker:
    worker_id: str
    max_batch_size: int
    order: int
    in_flight: dict[int, Batch] = dataclasses.field(default_factory=dict)
    last_completed_s: float = -math.inf
    draining: bool = False
    # Its time for a batch of max_batch_size, warmed up at load (None: not declared); bounds its first batch's time.
    warm_batch_time_s: float | None = None
    has_completed: bool = False

    def load(self) -> tuple[int, int, int]:
        return (len(self.in_flight), sum(len(b.items) for b in self.in_flight.values()), self.order)


class DynamicBatcher(Generic[P]):
    def __init__(self, config: BatcherConfig, clock: Clock) -> None:
        self.config = config
        self._clock = clock
        self._queue: FairQueue[QueuedItem[P]] = FairQueue(config.max_queue_size)
        self._queued: dict[int, QueuedItem[P]] = {}
        # (deadline_s, item_id) of queued items, a heap with lazy deletion: entries whose item is no
        # longer queued are skipped, so finding the most urgent item is O(log n), not a scan.
        self._deadlines: list[tuple[float, int]] = []
        self._workers: dict[str, _Worker] = {}
        self._batch_owner: dict[int, _Worker] = {}
        self._failed: list[FailedItem[P]] = []
        # Batch time by size: measured (EWMA), or a worker's warm-up figure while the size is in
        # _seeded_sizes (the first measurement of that size replaces it outright).
        self._batch_time_s: dict[int, float] = {}
        self._seeded_sizes: set[int] = set()
        self._item_ids = itertools.count(1)
        self._batch_ids = itertools.count(1)
        self._worker_order = itertools.count()
        self._standing = None if config.standing_queue is None else StandingQueue(config.standing_queue, clock())

    # -- workers -----------------------------------------------------------

    def add_worker(self, worker_id: str, max_batch_size: int, *, warm_batch_time_s: float | None = None) -> None:
        """`warm_batch_time_s`: the worker's own time for a batch of `max_batch_size` once warm (its
        load's warm-up), taken as that size's batch time until one is measured; None: unknown."""
        if worker_id in self._workers:
            raise ValueError(f"worker {worker_id!r} is already attached")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if warm_batch_time_s is not None and not 0 < warm_batch_time_s < math.inf:
            raise ValueError(f"warm_batch_time_s must be > 0 and finite, got {warm_batch_time_s}")
        self._workers[worker_id] = _Worker(worker_id, max_batch_size, next(self._worker_order),
                                           warm_batch_time_s=warm_batch_time_s)
        if warm_batch_time_s is not None:
            self._seed_batch_time(max_batch_size, warm_batch_time_s)

    def drain_worker(self, worker_id: str) -> None:
        """Sends the worker nothing new; what it holds may still complete."""
        self._workers[worker_id].draining = True

    def remove_worker(self, worker_id: str) -> list[QueuedItem[P]]:
        """The worker is gone: its in-flight items go back to the queue front; returns them.

        Items now expired, or dispatched `max_attempts` times, go to take_failed() instead.
        """
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return []
        now = self._clock()
        items = [item for batch in worker.in_flight.values() for item in batch.items]
        for batch_id in worker.in_flight:
            del self._batch_owner[batch_id]
        requeued = []
        for item in reversed(items):  # push_front in reverse keeps their order
            if item.deadline_s is not None and now >= item.deadline_s:
                self._failed.append(FailedItem(item, DeadlineExceeded("deadline passed while its worker was lost")))
            elif item.num_attempts >= self.config.max_attempts:
                self._failed.append(
                    FailedItem(item, Unavailable(f"worker lost {item.num_attempts} times while running this request"))
                )
            else:
                self._queue.push_front(item, item.tenant)
                self._queue_item(item)
                requeued.append(item)
        return requeued[::-1]

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def num_slots(self) -> int:
        """Items the usable workers hold at once: full batches, running and prefetched."""
        per_batch = self.config.max_batches_per_worker
        return sum(self._batch_limit(w) * per_batch for w in self._workers.values() if not w.draining)

    @property
    def num_usable_workers(self) -> int:
        """Workers that may get new batches (attached and not draining)."""
        return sum(not w.draining for w in self._workers.values())

    def has_free_worker(self) -> bool:
        """Whether a batch could go out now if one were ready (a worker has a free slot)."""
        return self._pick_worker(self._clock()) is not None

    # -- requests ----------------------------------------------------------

    def submit(self, payload: P, tenant: TenantContext, *, deadline_s: float | None,
               shape: Hashable = None, rows: int = 1) -> QueuedItem[P]:
        """Queues one request; `shape` and `rows`: see QueuedItem."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        now = self._clock()
        if not any(not w.draining for w in self._workers.values()):
            raise Unavailable("no worker serves this model", retry_after_s=self.config.no_worker_retry_after_s)
        if self._queue.is_full() and not self._queue.can_displace_for(tenant):
            raise ResourceExhausted(
                f"queue full: {len(self._queue)} requests waiting (max {self.config.max_queue_size})",
                retry_after_s=self.estimate_batch_time_s(self.config.max_batch_size),
            )
        if deadline_s is not None:
            _, done_s = self._estimate_run_s(self._queue.cost_ahead(tenant), now)
            if done_s > deadline_s:
                raise DeadlineExceeded(
                    f"cannot finish in time: estimated {done_s - now:.3f} s behind the queue, "
                    f"{max(0.0, deadline_s - now):.3f} s left"
                )
        item = QueuedItem(next(self._item_ids), payload, tenant, now, deadline_s, shape=shape, rows=rows)
        displaced = self._queue.push_displacing(item, tenant)
        self._queue_item(item)
        if displaced is not None:
            del self._queued[displaced.item_id]
            self._failed.append(
                FailedItem(
                    displaced,
                    ResourceExhausted(
                        f"queue full ({self.config.max_queue_size} requests): dropped the newest request "
                        f"of tenant {displaced.tenant.tenant_id!r}, which holds the most",
                        retry_after_s=self.estimate_batch_time_s(self.config.max_batch_size),
                    ),
                )
            )
        return item

    def cancel(self, item_id: int) -> bool:
        """Drops a still-queued item (the client went away); False if dispatched or unknown."""
        item = self._queued.pop(item_id, None)
        return item is not None and self._queue.remove(item)

    def abandon_queued(self, error: InfermeshError) -> None:
        """Gives up on everything queued (e.g. no worker came back in time); see take_failed()."""
        for item in self._queue.remove_where(lambda _: True):
            del self._queued[item.item_id]
            self._failed.append(FailedItem(item, error))

    def take_failed(self) -> list[FailedItem[P]]:
        """Items dropped since the last call (expired in queue, lost too often); fail their requests."""
        failed, self._failed = self._failed, []
        return failed

    # -- dispatch ----------------------------------------------------------

    def next_batch(self) -> Batch[P] | None:
        """The batch to send now, with its worker chosen; None when none should go yet."""
        now = self._clock()
        self._drop_expired(now)
        worker = self._pick_worker(now)
        if worker is None or not self._queue:
            return None
        size = self._batch_size(worker, now)
        if size == 0:
            return None
        limit = self._batch_limit(worker)
        items = self._take(size, limit, now)
        for item in items:
            del self._queued[item.item_id]
        self._watch_waits(items, limit, now)
        items = tuple(dataclasses.replace(item, num_attempts=item.num_attempts + 1) for item in items)
        batch = Batch(next(self._batch_ids), worker.worker_id, items, now)
        worker.in_flight[batch.batch_id] = batch
        self._batch_owner[batch.batch_id] = worker
        return batch

    @property
    def standing(self) -> bool:
        """Whether the queue is standing now (serving newest first, refusing long waiters)."""
        return self._standing is not None and self._standing.standing

    def time_until_ready(self) -> float | None:
        """Seconds until next_batch() may return a batch or drop an expired item; None: wait for an event
        (submit, complete, add_worker)."""
        if not self._queue:
            return None
        now = self._clock()
        expiry_s = self._earliest_deadline_s()
        worker = self._pick_worker(now)
        if worker is None:
            wake_s = min(expiry_s, self._next_prefetch_s(now))
            return None if wake_s == math.inf else max(0.0, wake_s - now)
        if self._batch_size(worker, now) > 0:
            return 0.0
        return max(0.0, min(self._must_dispatch_at_s(self._batch_limit(worker)), expiry_s) - now)

    def due_after_submit_s(self, item: QueuedItem[P]) -> float:
        """By when next_batch() must run again because `item` was just submitted, given that it was
        already planned for what was queued before (time_until_ready): at once when the queue was
        empty, a worker is idle, or the queue now makes a batch for a free worker, else the latest start that still meets the
        item's deadline (inf without one: the oldest item's delay or a worker's prefetch governs)."""
        num_queued = len(self._queue)
        if num_queued <= 1:
            return item.arrival_s
        worker = self._pick_worker(item.arrival_s)
        if worker is not None and ((not worker.in_flight and self.config.dispatch_to_idle_worker) or num_queued >= self._batch_limit(worker)
                                   or any(s <= num_queued for s in self.config.preferred_batch_sizes)):
            return item.arrival_s
        if item.deadline_s is None:
            return math.inf
        return item.deadline_s - self.estimate_batch_time_s(self.config.max_batch_size)

    def complete(self, batch_id: int, *, compute_s: float | None = None) -> Batch[P] | None:
        """The worker answered `batch_id`; None if unknown (its worker was removed and its items re-queued).

        `compute_s`: the worker's own measure of the batch; otherwise the time since the
        batch could start (dispatch, or the worker's previous completion if later).
        """
        worker = self._batch_owner.pop(batch_id, None)
        if worker is None:
            return None
        batch = worker.in_flight.pop(batch_id)
        now = self._clock()
        if compute_s is None:
            compute_s = now - max(batch.dispatched_at_s, worker.last_completed_s)
        if not worker.has_completed and worker.warm_batch_time_s is not None:
            compute_s = min(compute_s, worker.warm_batch_time_s)  # see the module doc: a cold first batch
        worker.last_completed_s = now
        worker.has_completed = True
        self._record_batch_time(len(batch.items), compute_s)
        return batch

    # -- estimates ---------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def queue_depth_of(self, priority: Priority) -> int:
        return self._queue.num_waiting(priority)

    @property
    def num_in_flight_items(self) -> int:
        return sum(len(batch.items) for worker in self._workers.values() for batch in worker.in_flight.values())

    def estimate_batch_time_s(self, size: int) -> float:
        """Known time of a batch of `size` (measured, else a worker's warm-up figure); other sizes
        borrow from the nearest larger known size, else scale the largest known one linearly (time
        grows with size)."""
        if size in self._batch_time_s:
            return self._batch_time_s[size]
        larger = [s for s in self._batch_time_s if s > size]
        if larger:
            return self._batch_time_s[min(larger)]
        if self._batch_time_s:
            largest = max(self._batch_time_s)
            return self._batch_time_s[largest] * size / largest
        return self.config.initial_batch_time_s

    def min_service_time_s(self) -> float:
        """A lower bound of a lone request's compute, for the gateway's deadline check (a deadline below it is
        refused, so an over-estimate refuses what could be served): the batch of one's time once known, else
        the least share per item of a known size (a batch's items share its time, so one alone takes no less;
        a worker's warm full batch of 16 at 30 ms gives 1.9 ms, where borrowing it whole read 30 ms), else
        the configured guess."""
        if 1 in self._batch_time_s:
            return self._batch_time_s[1]
        if self._batch_time_s:
            return min(seconds / size for size, seconds in self._batch_time_s.items())
        return self.config.initial_batch_time_s

    def estimated_queue_time_s(self, priority: Priority) -> float:
        """Wait before a new request of `priority` starts running, behind everything queued at
        its class or above (inf with no worker)."""
        now = self._clock()
        ahead = sum(self._queue.num_waiting(p) for p in Priority if p <= priority)
        start_s, _ = self._estimate_run_s(ahead, now)
        return start_s - now

    # -- internals ---------------------------------------------------------

    def _queue_item(self, item: QueuedItem[P]) -> None:
        self._queued[item.item_id] = item
        if item.deadline_s is not None:
            heapq.heappush(self._deadlines, (item.deadline_s, item.item_id))

    def _earliest_deadline_s(self) -> float:
        while self._deadlines and self._deadlines[0][1] not in self._queued:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else math.inf

    def _drop_expired(self, now: float) -> None:
        while self._earliest_deadline_s() <= now:
            _, item_id = heapq.heappop(self._deadlines)
            item = self._queued.pop(item_id)
            self._queue.remove(item)
            waited_s = now - item.arrival_s
            self._failed.append(FailedItem(item, DeadlineExceeded(f"deadline passed after {waited_s:.3f} s in queue")))

    def _take(self, size: int, limit: int, now: float) -> tuple[QueuedItem[P], ...]:
        """Up to `size` items in the fair queue's order, all of the first one's shape and at most
        `limit` rows together. An item of another shape (or one that would overflow the rows) is
        put back where it was, with its tenant's credit, and leads a later batch: mixed shapes are
        never stacked, and taking a shape out of turn costs no tenant its share. At most `limit`
        items are set aside per batch, which bounds the scan."""
        pop = self._standing_pop(limit, now) if self.standing else self._queue.pop_end
        first, _ = pop()
        taken, rows = [first], first.rows
        set_aside: list[tuple[QueuedItem[P], bool]] = []
        while len(taken) < size and self._queue and len(set_aside) < limit:
            item, at_back = pop()
            if item.shape == first.shape and rows + item.rows <= limit:
                taken.append(item)
                rows += item.rows
            else:
                set_aside.append((item, at_back))
        for item, at_back in reversed(set_aside):
            self._queue.put_back(item, item.tenant, at_back=at_back)
        return tuple(taken)

    def _standing_pop(self, limit: int, now: float) -> Callable[[], tuple[QueuedItem[P], bool]]:
        """Adaptive LIFO inside each tenant's turn: DRR picks the tenant, as always; of its items goes
        the newest (the most time left) if its own queue stands, else its oldest. A tenant's queue
        stands while its oldest waited longer than a queue that drains for a whole interval and less
        than `aging_s` (then it goes first: none starves). A light tenant beside a flood drains: its
        newest would only overtake its oldest."""
        standing = self._standing
        assert standing is not None  # only called while self.standing, which needs one
        aged_before_s = now - standing.config.aging_s
        stood_before_s = now - standing.stood_wait_s(self.estimate_batch_time_s(limit))

        def head_first(head: QueuedItem[P]) -> bool:
            return not aged_before_s < head.arrival_s < stood_before_s

        return lambda: self._queue.pop_end(newest=True, head_first=head_first)

    def _watch_waits(self, items: tuple[QueuedItem[P], ...], limit: int, now: float) -> None:
        if self._standing is None:
            return
        if not self._queue:
            self._standing.on_empty(now)
            return
        # The queue's oldest wait, not the served items': served newest-first they would hide the backlog.
        oldest_s = min(min(item.arrival_s for item in items), min(item.arrival_s for item in self._queue.heads()))
        self._standing.on_dispatch(now - oldest_s, self.estimate_batch_time_s(limit), now)

    def _pick_worker(self, now: float) -> _Worker | None:
        free = [w for w in self._workers.values() if self._has_slot(w) and self._prefetch_due_s(w, now) <= now]
        return min(free, key=_Worker.load, default=None)

    def _has_slot(self, worker: _Worker) -> bool:
        return not worker.draining and len(worker.in_flight) < self.config.max_batches_per_worker

    def _prefetch_due_s(self, worker: _Worker, now: float) -> float:
        """From when `worker` may take another batch (it has a slot): at once when idle, else
        `prefetch_lead_s` before what it holds is expected to be done."""
        if not worker.in_flight or self.config.prefetch_lead_s is None:
            return -math.inf
        return self._busy_until_s(worker, now) - self.config.prefetch_lead_s

    def _next_prefetch_s(self, now: float) -> float:
        return min((self._prefetch_due_s(w, now) for w in self._workers.values() if self._has_slot(w)),
                   default=math.inf)

    def _batch_limit(self, worker: _Worker) -> int:
        return min(self.config.max_batch_size, worker.max_batch_size)

    def _batch_size(self, worker: _Worker, now: float) -> int:
        """How many items to send `worker` now; 0: keep waiting."""
        limit = self._batch_limit(worker)
        num_queued = len(self._queue)
        if num_queued >= limit:
            return limit
        if not worker.in_flight and self.config.dispatch_to_idle_worker:
            return num_queued
        preferred = [s for s in self.config.preferred_batch_sizes if s <= num_queued]
        if preferred:
            return max(preferred)
        return num_queued if now >= self._must_dispatch_at_s(limit) else 0

    def _must_dispatch_at_s(self, limit: int) -> float:
        """When waiting for a fuller batch must end: the oldest item's max delay, or the latest
        start from which the most urgent item still finishes in a full batch."""
        # Each tenant's queue is in arrival order, so the oldest item is one of their heads.
        oldest_s = min(item.arrival_s for item in self._queue.heads())
        latest_start_s = self._earliest_deadline_s() - self.estimate_batch_time_s(limit)
        return min(oldest_s + self.config.max_queue_delay_s, latest_start_s)

    def _estimate_run_s(self, num_items_ahead: int, now: float) -> tuple[float, float]:
        """When the batch of an item with `num_items_ahead` queued before it would start and end,
        if batches go out as soon as a worker frees up (inf with no worker)."""
        workers = [w for w in self._workers.values() if not w.draining]
        if not workers:
            return math.inf, math.inf
        free_at = [(self._busy_until_s(w, now), w.order, w) for w in workers]
        heapq.heapify(free_at)
        remaining = num_items_ahead + 1
        while True:
            start_s, order, worker = heapq.heappop(free_at)
            size = min(remaining, self._batch_limit(worker))
            end_s = start_s + self.estimate_batch_time_s(size)
            remaining -= size
            if remaining == 0:
                return start_s, end_s
            heapq.heappush(free_at, (end_s, order, worker))

    def _busy_until_s(self, worker: _Worker, now: float) -> float:
        busy_s = sum(self.estimate_batch_time_s(len(b.items)) for b in worker.in_flight.values())
        if worker.in_flight:
            running = next(iter(worker.in_flight.values()))
            busy_s -= now - max(running.dispatched_at_s, worker.last_completed_s)
        return now + max(0.0, busy_s)

    def _seed_batch_time(self, size: int, warm_s: float) -> None:
        """A worker's warm-up figure for `size`, unless that size was measured; of several workers'
        figures the slowest, as a batch may go to any of them."""
        if size not in self._batch_time_s:
            self._batch_time_s[size] = warm_s
            self._seeded_sizes.add(size)
        elif size in self._seeded_sizes:
            self._batch_time_s[size] = max(self._batch_time_s[size], warm_s)

    def _record_batch_time(self, size: int, compute_s: float) -> None:
        previous = self._batch_time_s.get(size)
        if previous is None or size in self._seeded_sizes:
            self._seeded_sizes.discard(size)
            self._batch_time_s[size] = compute_s
        else:
            self._batch_time_s[size] = previous + self.config.batch_time_ewma_alpha * (compute_s - previous)
