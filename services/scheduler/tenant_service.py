"""Per-tenant service accounting for generate: virtual token counters and weighted shares.

Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024): each tenant's counter grows by the service it receives, prompt tokens weighted
lower than output tokens (1 and 2, as in the paper) and divided by the tenant's weight. Only
prompt tokens a worker computes count: those reused from the prefix cache cost nothing, and a
recompute after preemption is not charged again (the step scheduler charges them so). The
step scheduler admits from the tenant with the smallest counter and gives prompt chunks the
step's token budget in the same order, so service evens out however many requests a tenant
sends. When a tenant becomes active (its first unfinished sequence here) its counter is lifted
to the smallest counter among the active tenants of its class: time spent idle is not banked
as credit, while a tenant that was over-served keeps its debt.

Counters and shares are per priority class: classes stay strict, VTC orders tenants inside one.

A tenant's weighted share of the running slots is `slots * weight / (sum of the weights of the
class's active tenants)`. `fairness_victim` names the running sequence that gives way when a
tenant below its share waits: one of the most over-served tenant above its share, old enough.
The two thresholds (at least one slot each, integer rounding apart) make a swap never pay the
other way at once, so fairness preemption cannot ping-pong; the minimum run time bounds churn
when shares change or equally served tenants' counters cross.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.scheduler.fair_queue import Priority, TenantContext
from services.scheduler.sequence import Sequence

TenantKey = tuple[Priority, str]


@dataclass(frozen=True)
class ServiceCost:
    """Service units per token: output (decode) tokens cost more than prompt (prefill) ones."""

    prefill_token: float = 1.0
    decode_token: float = 2.0

    def __post_init__(self) -> None:
        if self.prefill_token < 0 or self.decode_token <= 0:
            raise ValueError(
                f"token costs must be prefill >= 0 and decode > 0, got {self.prefill_token} and {self.decode_token}"
            )


class TenantService:
    """Virtual token counters of the tenants of one model (shared by its workers' step schedulers)."""

    def __init__(self, cost: ServiceCost = ServiceCost()) -> None:
        self.cost = cost
        # Kept after a tenant goes idle so that an over-served tenant keeps its debt. One float per
        # tenant ever seen: tenants come from the gateway's configuration, a bounded set.
        self._counters: dict[TenantKey, float] = {}
        self._num_unfinished: Counter[TenantKey] = Counter()
        self._weights: dict[TenantKey, int] = {}  # active tenants' latest weights
        self._class_weights: Counter[Priority] = Counter()  # sums of _weights per class

    def activate(self, tenant: TenantContext) -> None:
        """One more unfinished sequence of `tenant`; the first lifts its counter (see module doc)."""
        key = tenant_key(tenant)
        if self._num_unfinished[key] == 0:
            floor = min((self._counters[k] for k in self._weights if k[0] == key[0]), default=0.0)
            self._counters[key] = max(self._counters.get(key, 0.0), floor)
        self._num_unfinished[key] += 1
        self._class_weights[key[0]] += tenant.weight - self._weights.get(key, 0)
        self._weights[key] = tenant.weight

    def deactivate(self, tenant: TenantContext) -> None:
        """One sequence of `tenant` finished or left this scheduler."""
        key = tenant_key(tenant)
        if self._num_unfinished[key] < 1:
            raise ValueError(f"tenant {tenant.tenant_id!r} has no unfinished sequence to deactivate")
        self._num_unfinished[key] -= 1
        if self._num_unfinished[key] == 0:
            del self._num_unfinished[key]
            self._class_weights[key[0]] -= self._weights.pop(key)

    def charge(self, tenant: TenantContext, *, num_prefill_tokens: int = 0, num_decode_tokens: int = 0) -> None:
        """Counts service given to `tenant`: prompt tokens computed (not those served from the prefix
        cache), output tokens sampled."""
        key = tenant_key(tenant)
        service = self.cost.prefill_token * num_prefill_tokens + self.cost.decode_token * num_decode_tokens
        self._counters[key] = self._counters.get(key, 0.0) + service / tenant.weight

    def counter(self, tenant: TenantContext) -> float:
        return self._counters.get(tenant_key(tenant), 0.0)

    def share(self, tenant: TenantContext) -> float:
        """The fraction of its class's capacity `tenant` is entitled to, among the active tenants."""
        return self._share(tenant_key(tenant), tenant.weight)

    def _share(self, key: TenantKey, weight: int) -> float:
        total = self._class_weights[key[0]]
        active_weight = self._weights.get(key)
        return active_weight / total if active_weight is not None else weight / (total + weight)

    def entitled_slots(self, tenant: TenantContext, num_slots: int) -> int:
        """Slots `tenant` may take from over-share tenants of its class: its share rounded down, at least one."""
        return self._entitled_slots(tenant_key(tenant), tenant.weight, num_slots)

    def _entitled_slots(self, key: TenantKey, weight: int, num_slots: int) -> int:
        return max(1, math.floor(num_slots * self._share(key, weight)))

    def slot_cap(self, tenant: TenantContext, num_slots: int) -> int:
        """Slots `tenant` keeps when others wait: its share rounded up, at least one."""
        return max(1, math.ceil(num_slots * self.share(tenant)))

    def admission_key(self, running: Iterable[Sequence], num_slots: int,
                      share_credit: float) -> Callable[[Sequence], tuple[int, float, float, int]]:
        """Sort key for the waiting tenants' next sequences (smallest first): class, then counter,
        with `share_credit` taken off for a tenant below its entitled slots, then age.

        The credit keeps admission from handing a slot to a tenant at its share when another,
        about as served, waits below its share and would only preempt it back (churn between two
        tenants that both want more than half); a tenant clearly less served still goes first.
        """
        held = _held_slots(running)
        counters = self._counters

        # Called for every waiting tenant at every step that admits: the tenant's key is built once
        # (counter() and entitled_slots() would each build it again).
        def key(seq: Sequence) -> tuple[int, float, float, int]:
            tenant = seq.tenant
            tkey = tenant_key(tenant)
            counter = counters.get(tkey, 0.0)
            if held[tkey] < self._entitled_slots(tkey, tenant.weight, num_slots):
                counter -= share_credit
            return (int(seq.priority), counter, seq.arrival_s, seq.seq_id)

        return key

    def fairness_victim(self, waiter: TenantContext, running: Iterable[Sequence], num_slots: int, now_s: float,
                        min_run_s: float) -> Sequence | None:
        """The running sequence to preempt so that `waiter`'s sequence gets a slot, or None.

        Only when `waiter` holds fewer than its entitled slots; the victim is the newest sequence
        that has run `min_run_s`, of the same-class tenant with the highest counter among those
        holding more than their slot cap and more served than `waiter`.
        """
        same_class = [s for s in running if s.priority == waiter.priority]
        held = _held_slots(same_class)
        if held[tenant_key(waiter)] >= self.entitled_slots(waiter, num_slots):
            return None
        waiter_counter = self.counter(waiter)
        # Over their cap and more served: each tenant checked once, not once per running sequence.
        tenants = {tenant_key(s.tenant): s.tenant for s in same_class}
        over = {key for key, tenant in tenants.items() if key != tenant_key(waiter)
                and held[key] > self.slot_cap(tenant, num_slots) and self.counter(tenant) > waiter_counter}
        candidates = [
            s for s in same_class
            if tenant_key(s.tenant) in over
            and s.running_since_s is not None and now_s - s.running_since_s >= min_run_s
        ]
        return max(candidates, key=lambda s: (self.counter(s.tenant), s.arrival_s, s.seq_id), default=None)


def _held_slots(running: Iterable[Sequence]) -> Counter[TenantKey]:
    """Running sequences per (class, tenant)."""
    return Counter(tenant_key(s.tenant) for s in running)


def tenant_key(tenant: TenantContext) -> TenantKey:
    return (tenant.priority, tenant.tenant_id)
