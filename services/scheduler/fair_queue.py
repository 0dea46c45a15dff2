"""Per-tenant queues served by priority class, then weighted deficit round robin.

Service order: strict priority between classes (CRITICAL before STANDARD before
SHEDDABLE); inside a class, tenants take turns by deficit round robin (Shreedhar
& Varghese): on each visit a tenant earns `quantum * weight` credit and is served
while its credit covers the cost of its oldest entry. A tenant whose queue empties
leaves the round and forfeits its credit, so idling cannot bank service.

Used by both batchers: the dynamic batcher's entries cost 1 (one classify item),
the step scheduler's cost their prompt tokens, so fairness is in tokens.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from services.common.errors import ResourceExhausted
from services.common.priority import Priority

T = TypeVar("T")


@dataclass(frozen=True)
class TenantContext:
    """Who is asking, as established by the gateway (mirrors infermesh.v1.TenantContext)."""

    tenant_id: str
    priority: Priority = Priority.STANDARD
    # Relative share inside the priority class, >= 1.
    weight: int = 1

    def __post_init__(self) -> None:
        if not self.tenant_id:
            raise ValueError("tenant_id must be non-empty")
        if self.weight < 1:
            raise ValueError(f"weight must be >= 1, got {self.weight}")


@dataclass
class _Entry(Generic[T]):
    item: T
    cost: int


class _TenantQueue(Generic[T]):
    def __init__(self, tenant: TenantContext) -> None:
        self.tenant = tenant
        self.entries: deque[_Entry[T]] = deque()
        self.total_cost = 0
        self.deficit = 0


class _PriorityClass(Generic[T]):
    """The tenants of one priority class that have entries, in round-robin order."""

    def __init__(self) -> None:
        # Invariant: exactly the tenants with a non-empty queue; ring[0] is the
        # tenant being visited and has already been granted its quantum.
        self.ring: deque[_TenantQueue[T]] = deque()
        self.by_tenant: dict[str, _TenantQueue[T]] = {}
        self.num_entries = 0
        self.total_cost = 0


class FairQueue(Generic[T]):
    """A bounded multi-tenant queue; `peek`/`pop` give entries in service order.

    `push` raises ResourceExhausted when `max_size` entries wait. `push_displacing`
    instead pushes out the newest entry of the longest tenant queue of the same or a
    lower class, so one tenant flooding a full queue cannot lock the others out
    (longest-queue drop); `push_over_share` refuses that longest queue's tenant instead, and
    admits the others over the bound. `push_front` (re-queueing work that was already accepted)
    ignores the bound, because an accepted request must never be lost to its own retry.
    """

    def __init__(self, max_size: int, *, quantum: int = 1, retry_after_s: float = 0.1) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        if quantum < 1:
            raise ValueError(f"quantum must be >= 1, got {quantum}")
        self.max_size = max_size
        self.quantum = quantum
        self.retry_after_s = retry_after_s
        self._classes: dict[Priority, _PriorityClass[T]] = {p: _PriorityClass() for p in Priority}
        # id(item) -> (priority, tenant_id), so remove() finds the right tenant queue.
        self._where: dict[int, tuple[Priority, str]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._where

    def is_full(self) -> bool:
        return len(self) >= self.max_size

    def push(self, item: T, tenant: TenantContext, *, cost: int = 1) -> None:
        if self.is_full():
            raise ResourceExhausted(
                f"queue full: {len(self)} requests waiting (max {self.max_size})",
                retry_after_s=self.retry_after_s,
            )
        self._add(item, tenant, cost, front=False)

    def can_displace_for(self, tenant: TenantContext) -> bool:
        """Whether `push_displacing` for `tenant` would succeed on a full queue."""
        return self._longest_queue_at_or_below(tenant) is not None

    def has_room_for(self, tenant: TenantContext) -> bool:
        """Whether `push_over_share` for `tenant` would succeed: the queue is not full, or another
        tenant of its class or below holds more than its weighted share (the one a full queue refuses)."""
        return not self.is_full() or self.can_displace_for(tenant)

    def push_over_share(self, item: T, tenant: TenantContext, *, cost: int = 1) -> None:
        """Like `push`, but a full queue still takes the entry of a tenant that `push_displacing` would
        make room for, without dropping anything: for entries that cannot be dropped once accepted
        (a generate stream). The bound then holds for the tenant with the longest queue, which is
        refused; the others may exceed it by at most what that tenant holds, weighted."""
        if not self.has_room_for(tenant):
            raise ResourceExhausted(
                f"queue full: {len(self)} requests waiting (max {self.max_size})",
                retry_after_s=self.retry_after_s,
            )
        self._add(item, tenant, cost, front=False)

    def push_displacing(self, item: T, tenant: TenantContext, *, cost: int = 1) -> T | None:
        """Like `push`, but when full, displaces (removes and returns) the newest entry of the
        longest tenant queue in the class of `tenant` or below, if that queue is longer than
        this tenant's own would become. Raises ResourceExhausted when nothing can be displaced."""
        displaced = None
        if self.is_full():
            victim = self._longest_queue_at_or_below(tenant)
            if victim is None:
                raise ResourceExhausted(
                    f"queue full: {len(self)} requests waiting (max {self.max_size})",
                    retry_after_s=self.retry_after_s,
                )
            displaced = victim.entries[-1].item
            self.remove(displaced)
        self._add(item, tenant, cost, front=False)
        return displaced

    def push_front(self, item: T, tenant: TenantContext, *, cost: int = 1) -> None:
        """Put `item` ahead of its tenant's other entries (re-queued or preempted work)."""
        self._add(item, tenant, cost, front=True)

    def peek(self) -> T | None:
        queue = self._next_tenant()
        return None if queue is None else queue.entries[0].item

    def pop(self, *, newest: bool = False, head_first: Callable[[T], bool] | None = None) -> T:
        """The next entry in DRR order: the chosen tenant's oldest, or its newest with `newest`
        (adaptive LIFO under a standing queue: the newest entry still has the most time left)
        unless `head_first(its oldest)` holds (that one waited too long to wait any more).

        DRR alone chooses the tenant; `newest` and `head_first` only choose which of its entries."""
        return self.pop_end(newest=newest, head_first=head_first)[0]

    def pop_end(self, *, newest: bool = False, head_first: Callable[[T], bool] | None = None) -> tuple[T, bool]:
        """pop(), and whether the entry came off its tenant's back (its newest) rather than its front:
        where put_back() returns it."""
        queue = self._next_tenant()
        if queue is None:
            raise IndexError("pop from an empty FairQueue")
        if newest and head_first is not None and head_first(queue.entries[0].item):
            newest = False  # it waited too long: it goes now, before what came after it
        if newest and queue.entries[-1].cost > queue.deficit:
            newest = False  # DRR granted credit for the head's cost; keep the accounting exact
        entry = queue.entries.pop() if newest else queue.entries.popleft()
        queue.deficit -= entry.cost
        self._forget(queue, entry)
        return entry.item, newest

    def put_back(self, item: T, tenant: TenantContext, *, cost: int = 1, at_back: bool = False) -> None:
        """Undoes a pop_end() whose entry cannot go now (the batch it was taken for has another
        shape): it returns to the end of its tenant's queue it came from, and its cost to the
        tenant's credit, so the tenant keeps its turn. Put several back in reverse order of their
        pops. Ignores the bound, as push_front does."""
        self._add(item, tenant, cost, front=not at_back)
        queue = self._classes[tenant.priority].by_tenant[tenant.tenant_id]
        queue.deficit += cost

    def take(self, item: T) -> None:
        """Serve `item` out of turn (the scheduler skipped entries it cannot run now): removed and
        charged to its tenant's credit like pop(), which may go negative and is repaid in later turns."""
        priority, tenant_id = self._where[id(item)]
        queue = self._classes[priority].by_tenant[tenant_id]
        cost = next(entry.cost for entry in queue.entries if entry.item is item)
        queue.deficit -= cost
        self.remove(item)

    def remove(self, item: T) -> bool:
        """Drop `item` wherever it waits; False if it is not queued."""
        where = self._where.get(id(item))
        if where is None:
            return False
        queue = self._classes[where[0]].by_tenant[where[1]]
        for entry in queue.entries:
            if entry.item is item:
                queue.entries.remove(entry)
                self._forget(queue, entry)
                return True
        raise AssertionError("FairQueue index out of sync")  # unreachable: _where mirrors the queues

    def remove_where(self, predicate: Callable[[T], bool]) -> list[T]:
        """Drop every entry for which `predicate` holds (expired, cancelled); returns them."""
        doomed = [item for item in self if predicate(item)]
        for item in doomed:
            self.remove(item)
        return doomed

    def __iter__(self) -> Iterator[T]:
        """All entries, by priority class then tenant then age (not the DRR interleaving)."""
        for cls in self._classes.values():
            for queue in list(cls.ring):
                for entry in list(queue.entries):
                    yield entry.item

    def heads(self) -> Iterator[T]:
        """The oldest entry of each tenant (each tenant's entries keep their order)."""
        for cls in self._classes.values():
            for queue in cls.ring:
                yield queue.entries[0].item

    def num_waiting(self, priority: Priority | None = None) -> int:
        if priority is None:
            return len(self)
        return self._classes[priority].num_entries

    def total_cost(self, priority: Priority | None = None) -> int:
        """Summed cost of the entries of one class (or all)."""
        if priority is None:
            return sum(cls.total_cost for cls in self._classes.values())
        return self._classes[priority].total_cost

    def cost_ahead(self, tenant: TenantContext, cost: int = 1) -> int:
        """Estimated cost served before a new entry of `tenant` would be, ignoring later arrivals.

        Every entry of a higher class comes first. Inside the class, DRR serves each
        other tenant about `weight / tenant.weight` times as much as this tenant
        needs to reach the new entry, capped by what that tenant has queued.
        """
        ahead = sum(self._classes[p].total_cost for p in Priority if p < tenant.priority)
        cls = self._classes[tenant.priority]
        own = cls.by_tenant.get(tenant.tenant_id)
        own_cost = own.total_cost if own is not None else 0
        for queue in cls.ring:
            if queue is not own:
                share = math.ceil((own_cost + cost) * queue.tenant.weight / tenant.weight)
                ahead += min(queue.total_cost, share)
        return ahead + own_cost

    # -- internals ---------------------------------------------------------

    def _add(self, item: T, tenant: TenantContext, cost: int, *, front: bool) -> None:
        if cost < 1:
            raise ValueError(f"cost must be >= 1, got {cost}")
        if id(item) in self._where:
            raise ValueError("item is already queued")
        cls = self._classes[tenant.priority]
        queue = cls.by_tenant.get(tenant.tenant_id)
        if queue is None:
            queue = cls.by_tenant[tenant.tenant_id] = _TenantQueue(tenant)
            if not cls.ring:
                queue.deficit = self._grant(queue)
            cls.ring.append(queue)
        queue.tenant = tenant  # the latest weight wins
        entry = _Entry(item, cost)
        if front:
            queue.entries.appendleft(entry)
        else:
            queue.entries.append(entry)
        cls.num_entries += 1
        cls.total_cost += cost
        queue.total_cost += cost
        self._where[id(item)] = (tenant.priority, tenant.tenant_id)

    def _forget(self, queue: _TenantQueue[T], entry: _Entry[T]) -> None:
        priority = queue.tenant.priority
        cls = self._classes[priority]
        del self._where[id(entry.item)]
        cls.num_entries -= 1
        cls.total_cost -= entry.cost
        queue.total_cost -= entry.cost
        if queue.entries:
            return
        was_visited = cls.ring[0] is queue
        cls.ring.remove(queue)
        del cls.by_tenant[queue.tenant.tenant_id]
        if was_visited and cls.ring:
            cls.ring[0].deficit += self._grant(cls.ring[0])

    def _longest_queue_at_or_below(self, tenant: TenantContext) -> _TenantQueue[T] | None:
        own = self._classes[tenant.priority].by_tenant.get(tenant.tenant_id)
        own_len = len(own.entries) if own is not None else 0
        best: _TenantQueue[T] | None = None
        for priority in sorted(Priority, reverse=True):  # lowest class first
            if priority < tenant.priority:
                break
            for queue in self._classes[priority].ring:
                if queue is own:
                    continue
                # Weighted: a tenant of weight 3 may hold three times as many entries.
                if len(queue.entries) * tenant.weight > (own_len + 1) * queue.tenant.weight and (
                    best is None or len(queue.entries) > len(best.entries)
                ):
                    best = queue
            if best is not None:
                return best
        return None

    def _next_tenant(self) -> _TenantQueue[T] | None:
        for cls in self._classes.values():
            if cls.ring:
                return self._visit(cls)
        return None

    def _visit(self, cls: _PriorityClass[T]) -> _TenantQueue[T]:
        # Terminates: every rotation grants credit >= 1 to the new head.
        while cls.ring[0].deficit < cls.ring[0].entries[0].cost:
            cls.ring.rotate(-1)
            cls.ring[0].deficit += self._grant(cls.ring[0])
        return cls.ring[0]

    def _grant(self, queue: _TenantQueue[T]) -> int:
        return self.quantum * queue.tenant.weight
