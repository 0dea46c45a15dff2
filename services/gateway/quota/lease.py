"""Tenant quotas shared by every gateway replica: local slices leased from a shared store.

The shared store (services/gateway/quota/store.py) holds one token bucket per tenant and
quota (requests/s, tokens/s) and a table of in-flight slots per tenant. This module is the
gateway's side of it and does no I/O: requests are admitted from local slices only, and a
background loop (services/gateway/quota/sync.py) calls `plan()` every lease interval, sends the
plan to the store in one atomic script, and hands the reply to `apply()`.

Invariants, with the store reachable:
  * Rates: a slice is taken out of the shared bucket before it is spent, and each sync gives
    the whole unused slice back (the script adds it back and takes the new one in one step).
    So all gateways together admit at most burst + rate x elapsed, as one gateway would.
    What is spent during the sync's own round trip is settled against the new grant
    (`apply`), so there is no gap with an empty slice and no double spending that lasts.
  * In-flight: slots are leased, not counted after the fact. The script grants a gateway at
    most the slots the other live gateways do not hold, so the tenant's requests in flight
    across all gateways never exceed max_in_flight. Slots nobody wants are spread as headroom
    for bursts; when the wants exceed the quota, a gateway may keep what the others are not
    entitled to (their wants up to their fair shares, which add up to max: floor(max / live
    gateways) each, the remainder to some of them in a rotating order), and shrinks to that as
    its requests end.
The bucket in the store is capped at the tenant's burst like any token bucket: refill that
arrives while it is full is lost. With a lease interval of I seconds, a burst below
rate x I makes the tenant get less than its rate (docs/gateway.md, "Quotas across gateways").

When the store cannot be reached (`store_unreachable`), every gateway falls back to a local
bucket at quota / (live gateways it last knew, or `expected_gateways` before it ever knew),
keeps serving, and leases again as soon as a sync succeeds.

Not thread-safe by design: the gateway calls it from its one event loop.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.clock import Clock
from services.gateway.quota.quotas import QuotaExceeded
from services.gateway.tenants.directory import Tenant, TenantQuota

# Demand below this many units over the next intervals is none: the smoothed rate of a tenant
# that stopped decays towards zero but never reaches it.
_IDLE = 0.05


class LeaseMode(enum.Enum):
    # Admitting from slices leased from the store.
    LEASED = "leased"
    # The store is unreachable (or never answered): a local bucket at quota / live gateways.
    FALLBACK = "fallback"


@dataclass(frozen=True)
class LeaseConfig:
    # How often slices are leased and given back.
    interval_s: float = 0.1
    # Gateways assumed alive until the store has said how many there are (the fallback divisor
    # of a gateway that never reached the store): set it to the replica count.
    expected_gateways: int = 1
    # A slice covers this many intervals of recent demand, so a gateway does not run dry
    # before its next lease when its load rises.
    headroom: float = 2.0
    # Weight of the newest interval in the demand estimate (exponential moving average).
    demand_smoothing: float = 0.5

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"lease interval_s must be > 0, got {self.interval_s}")
        if self.expected_gateways < 1:
            raise ValueError(f"expected_gateways must be >= 1, got {self.expected_gateways}")
        if not self.headroom >= 1:
            raise ValueError(f"lease headroom must be >= 1, got {self.headroom}")
        if not 0 < self.demand_smoothing <= 1:
            raise ValueError(f"demand_smoothing must be in (0, 1], got {self.demand_smoothing}")


@dataclass(frozen=True)
class TenantAsk:
    """One tenant's part of a sync: what this gateway gives back and what it would like."""

    tenant_id: str
    quota: TenantQuota
    # Unused slices handed back to the shared buckets (0 in fallback: a fallback bucket's
    # tokens never came from the store).
    return_requests: float
    return_tokens: float
    # What recent demand needs until the next sync; 0 when the tenant was idle here lately.
    want_requests: float
    want_tokens: float
    # Requests of this tenant in flight here now: the slots this gateway holds whatever it is granted.
    num_in_flight: int
    want_in_flight: int
    # Headroom for the next arrivals, granted only out of what no other gateway wants.
    floor_requests: float = 0.0
    floor_tokens: float = 0.0


@dataclass(frozen=True)
class LeasePlan:
    asks: tuple[TenantAsk, ...]


@dataclass(frozen=True)
class TenantGrant:
    tenant_id: str
    requests: float
    tokens: float
    # Requests of this tenant this gateway may have in flight until the next sync.
    in_flight_limit: int


@dataclass(frozen=True)
class LeaseReply:
    num_live_gateways: int
    grants: tuple[TenantGrant, ...]
    # Store keys that held garbage (wrong type, unparsable or negative values); the script
    # ignored or reset them, the caller logs them.
    bad_keys: tuple[str, ...] = ()


class _Allowance:
    """A local slice: spent by admissions; refills only in fallback (rate/N up to burst/N)."""

    def __init__(self) -> None:
        self.level = 0.0
        self.rate_per_s = 0.0
        self.cap = math.inf
        self._updated_s = 0.0
        # Level when the sync now under way was planned; what was spent since is settled in apply().
        self.level_at_plan = 0.0

    def refill(self, now_s: float) -> float:
        elapsed_s = now_s - self._updated_s
        self._updated_s = now_s
        if elapsed_s > 0 and self.rate_per_s > 0 and self.level < self.cap:
            self.level = min(self.cap, self.level + elapsed_s * self.rate_per_s)
        return self.level

    def lease(self, granted: float, now_s: float) -> None:
        self.refill(now_s)
        spent_since_plan = self.level_at_plan - self.level
        if self.rate_per_s > 0:
            # Leaving fallback: the local bucket's tokens never came from the store and are
            # dropped; only what was spent during the round trip is owed.
            spent_since_plan = max(0.0, spent_since_plan)
        self.level = granted - spent_since_plan
        self.rate_per_s = 0.0
        self.cap = math.inf
        self.level_at_plan = self.level

    def fall_back(self, rate_per_s: float, cap: float, now_s: float) -> None:
        self.refill(now_s)
        self.rate_per_s = rate_per_s
        self.cap = cap
        # A slice carries over (capped): it was taken from the store, and topping up to a full
        # fallback burst at the switch would hand out extra.
        self.level = min(self.level, cap)


class _Demand:
    """Units asked for (admitted or refused) per second, smoothed over sync intervals."""

    def __init__(self) -> None:
        self.num_since_plan = 0.0
        self.rate_per_s = 0.0
        self.largest = 0.0  # the largest single charge lately (tokens: one generate's prompt + max)

    def add(self, amount: float) -> None:
        self.num_since_plan += amount
        self.largest = max(self.largest, amount)

    def close_interval(self, elapsed_s: float, smoothing: float) -> float:
        sample = self.num_since_plan / elapsed_s
        self.rate_per_s += smoothing * (sample - self.rate_per_s)
        self.num_since_plan = 0.0
        self.largest *= 1 - smoothing / 4  # forgotten over ~8 intervals, not at once
        return self.rate_per_s


class _TenantShare:
    def __init__(self, quota: TenantQuota) -> None:
        self.quota = quota
        self.requests = _Allowance()
        self.tokens = _Allowance()
        self.num_in_flight = 0
        self.in_flight_limit = 0
        self.requests_wanted = _Demand()
        self.tokens_wanted = _Demand()
        self.starts_wanted = _Demand()


class SharedQuotaLease:
    """One admitted request's hold on its tenant's local share; release exactly once."""

    def __init__(self, quotas: SharedQuotas, share: _TenantShare, tenant_id: str, num_tokens_charged: int) -> None:
        self._quotas = quotas
        self._share = share
        self.tenant_id = tenant_id
        self.num_tokens_charged = num_tokens_charged
        self.released = False

    def release(self, num_tokens_used: int | None = None) -> int:
        """End the request, settling its charge to what it used (to the local slice, so the next
        sync returns a refund to the shared bucket, or settles what was used past the charge as
        any spend). Same contract as quotas.QuotaLease.release."""
        if self.released:
            return 0
        self.released = True
        self._share.num_in_flight -= 1
        used = self.num_tokens_charged if num_tokens_used is None else max(0, num_tokens_used)
        refund = max(0, self.num_tokens_charged - used)
        if refund or used > self.num_tokens_charged:
            tokens = self._share.tokens
            tokens.refill(self._quotas.clock())
            tokens.level = min(tokens.cap, tokens.level + refund) if refund else \
                tokens.level - (used - self.num_tokens_charged)
        return refund


class SharedQuotas:
    """Admission against leased slices; same admit()/update() surface as quotas.TenantQuotas."""

    def __init__(self, clock: Clock, config: LeaseConfig, *, in_flight_retry_after_s: float = 0.1) -> None:
        self.clock = clock
        self.config = config
        self.in_flight_retry_after_s = in_flight_retry_after_s
        self.mode = LeaseMode.FALLBACK
        self.num_live_gateways = config.expected_gateways
        self._shares: dict[str, _TenantShare] = {}
        self._planned_s: float | None = None

    # -- tenants ---------------------------------------------------------------------------

    def update(self, tenants: Iterable[Tenant]) -> None:
        """Apply (re)loaded quotas; known tenants keep slices and in-flight counts."""
        fresh: dict[str, _TenantShare] = {}
        for tenant in tenants:
            share = self._shares.get(tenant.tenant_id)
            if share is None:
                share = self._new_share(tenant.quota)
            else:
                share.quota = tenant.quota
                if self.mode is LeaseMode.FALLBACK:
                    self._fall_back(share)
            fresh[tenant.tenant_id] = share
        self._shares = fresh

    def tenant_ids(self) -> frozenset[str]:
        return frozenset(self._shares)

    # -- the hot path ----------------------------------------------------------------------

    def admit(self, tenant: Tenant, num_tokens: int = 0) -> SharedQuotaLease:
        """Charge one request (and `num_tokens` tokens) to the local share or raise QuotaExceeded."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        share = self._share_of(tenant)
        quota = share.quota
        now_s = self.clock()
        share.requests_wanted.add(1)
        share.tokens_wanted.add(num_tokens)
        who = f"tenant '{tenant.tenant_id}'"
        if share.num_in_flight >= share.in_flight_limit:
            share.starts_wanted.add(1)
            raise QuotaExceeded(
                f"{who} has {share.num_in_flight} requests in flight here and may have "
                f"{share.in_flight_limit} at this gateway now (limit {quota.max_in_flight} "
                f"across all gateways)",
                "max_in_flight",
                retry_after_s=self.in_flight_retry_after_s,
            )
        if num_tokens > quota.tokens_burst:
            raise QuotaExceeded(
                f"request needs {num_tokens} tokens (prompt + max_tokens) but {who} may use at most "
                f"{quota.tokens_burst:g} at once; lower max_tokens",
                "tokens_burst",
            )
        if share.requests.refill(now_s) < 1:
            raise QuotaExceeded(
                f"{who} is over its request rate quota ({quota.requests_per_s:g} requests/s, "
                f"burst {quota.requests_burst:g}, across all gateways); "
                f"retry after {self._wait_s(share.requests, 1):.3f} s",
                "requests_per_s",
                retry_after_s=self._wait_s(share.requests, 1),
            )
        # A fallback bucket holds burst / N, which may be less than one request's tokens: there the
        # request needs a full bucket and leaves a debt that the refill pays off.
        needed = num_tokens if self.mode is LeaseMode.LEASED else min(num_tokens, share.tokens.cap)
        if num_tokens and share.tokens.refill(now_s) < needed:
            wait_s = self._wait_s(share.tokens, needed)
            raise QuotaExceeded(
                f"{who} is over its token rate quota ({quota.tokens_per_s:g} tokens/s, "
                f"burst {quota.tokens_burst:g}, across all gateways): request needs {num_tokens} "
                f"tokens; retry after {wait_s:.3f} s",
                "tokens_per_s",
                retry_after_s=wait_s,
            )
        share.starts_wanted.add(1)
        share.requests.level -= 1
        share.tokens.level -= num_tokens
        share.num_in_flight += 1
        return SharedQuotaLease(self, share, tenant.tenant_id, num_tokens)

    def num_in_flight(self, tenant_id: str) -> int:
        share = self._shares.get(tenant_id)
        return 0 if share is None else share.num_in_flight

    def tokens_available(self, tenant_id: str) -> float:
        share = self._shares.get(tenant_id)
        return 0.0 if share is None else share.tokens.refill(self.clock())

    # -- the sync loop's side ----------------------------------------------------------------

    def plan(self) -> LeasePlan:
        """What to give back and ask for, per tenant; call once per sync, then apply() or
        store_unreachable()."""
        now_s = self.clock()
        elapsed_s = self.config.interval_s if self._planned_s is None else max(now_s - self._planned_s, 1e-3)
        self._planned_s = now_s
        return LeasePlan(tuple(self._ask(tenant_id, share, elapsed_s, now_s)
                               for tenant_id, share in self._shares.items()))

    def apply(self, reply: LeaseReply) -> bool:
        """Take the store's grants. Returns True when this ends a fallback (the store is back)."""
        now_s = self.clock()
        resumed = self.mode is LeaseMode.FALLBACK
        self.mode = LeaseMode.LEASED
        self.num_live_gateways = max(1, reply.num_live_gateways)
        granted = {grant.tenant_id: grant for grant in reply.grants}
        for tenant_id, share in self._shares.items():
            grant = granted.get(tenant_id)
            if grant is None:  # a tenant added after the plan: nothing leased for it yet
                grant = TenantGrant(tenant_id, 0.0, 0.0, 0)
            share.requests.lease(grant.requests, now_s)
            share.tokens.lease(grant.tokens, now_s)
            share.in_flight_limit = grant.in_flight_limit
        return resumed

    def store_unreachable(self) -> bool:
        """The sync failed: fall back to local buckets. Returns True when this starts a fallback."""
        started = self.mode is LeaseMode.LEASED
        self.mode = LeaseMode.FALLBACK
        for share in self._shares.values():
            self._fall_back(share)
        return started

    # -- internals ---------------------------------------------------------------------------

    def _ask(self, tenant_id: str, share: _TenantShare, elapsed_s: float, now_s: float) -> TenantAsk:
        config = self.config
        quota = share.quota
        horizon_s = config.interval_s * config.headroom
        request_rate = share.requests_wanted.close_interval(elapsed_s, config.demand_smoothing)
        token_rate = share.tokens_wanted.close_interval(elapsed_s, config.demand_smoothing)
        start_rate = share.starts_wanted.close_interval(elapsed_s, config.demand_smoothing)
        leased = self.mode is LeaseMode.LEASED
        for allowance in (share.requests, share.tokens):
            allowance.level_at_plan = allowance.refill(now_s)
        # Demand: the recent rate over the next intervals; while there is any, at least one request
        # and the largest recent token charge, so a slow tenant is not leased fractions forever.
        request_demand = request_rate * horizon_s
        want_requests = 0.0 if request_demand < _IDLE else min(quota.requests_burst, max(1.0, request_demand))
        token_demand = token_rate * horizon_s
        want_tokens = 0.0 if token_demand < _IDLE else min(
            quota.tokens_burst, max(share.tokens_wanted.largest, token_demand))
        # Headroom, even idle: this gateway's share of the burst (at least one request), so a
        # burst is admitted at once as it would be by a lone gateway's bucket. The store grants it
        # only out of what the other gateways do not want, so idle gateways never park what a
        # busy one needs.
        floor_requests = min(quota.requests_burst, max(1.0, quota.requests_burst / self.num_live_gateways))
        floor_tokens = quota.tokens_burst / self.num_live_gateways
        want_in_flight = min(quota.max_in_flight, share.num_in_flight + 1 + math.ceil(start_rate * horizon_s))
        return TenantAsk(
            tenant_id=tenant_id,
            quota=quota,
            return_requests=max(0.0, share.requests.level_at_plan) if leased else 0.0,
            return_tokens=max(0.0, share.tokens.level_at_plan) if leased else 0.0,
            want_requests=want_requests,
            want_tokens=want_tokens,
            num_in_flight=share.num_in_flight,
            want_in_flight=want_in_flight,
            floor_requests=floor_requests,
            floor_tokens=floor_tokens,
        )

    def _new_share(self, quota: TenantQuota) -> _TenantShare:
        share = _TenantShare(quota)
        if self.mode is LeaseMode.FALLBACK:
            self._fall_back(share)
            # A new tenant starts with its fallback burst, as a local bucket would.
            share.requests.level = share.requests.cap
            share.tokens.level = share.tokens.cap
        return share

    def _fall_back(self, share: _TenantShare) -> None:
        quota = share.quota
        num_gateways = self.num_live_gateways
        now_s = self.clock()
        # Requests: at least one, or a tenant whose burst is below the gateway count could never
        # be admitted anywhere (N gateways may then admit N at once: the bound when burst < N).
        share.requests.fall_back(quota.requests_per_s / num_gateways,
                                 max(1.0, quota.requests_burst / num_gateways), now_s)
        share.tokens.fall_back(quota.tokens_per_s / num_gateways, quota.tokens_burst / num_gateways, now_s)
        share.in_flight_limit = max(1, quota.max_in_flight // num_gateways)

    def _wait_s(self, allowance: _Allowance, amount: float) -> float:
        if self.mode is LeaseMode.LEASED or allowance.rate_per_s <= 0:
            return self.config.interval_s  # the next lease is the next chance
        return max(0.0, amount - allowance.level) / allowance.rate_per_s

    def _share_of(self, tenant: Tenant) -> _TenantShare:
        share = self._shares.get(tenant.tenant_id)
        if share is None:  # a tenant from a newer directory than the last update(); adopt it
            share = self._new_share(tenant.quota)
            self._shares[tenant.tenant_id] = share
        return share
