"""Per-tenant quotas: requests/s and tokens/s token buckets, and an in-flight cap.

A request is admitted only if every limit has room; a rejected request takes
nothing from any bucket, so a flood of rejections does not push a tenant's
retry_after further out. Generate is charged prompt + max tokens up front and
the unused part is refunded when it ends (`QuotaLease.release`).

Not thread-safe by design: the gateway calls it from its one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from services.common.clock import Clock
from services.common.errors import ResourceExhausted
from services.gateway.tenants.directory import Tenant, TenantQuota


class Lease(Protocol):
    """What admission holds for an admitted request: QuotaLease here, or quota_lease.SharedQuotaLease."""

    def release(self, num_tokens_used: int | None = None) -> int: ...


class Quotas(Protocol):
    """Tenant quotas as admission uses them: TenantQuotas here, or quota_lease.SharedQuotas."""

    def admit(self, tenant: Tenant, num_tokens: int = 0) -> Lease: ...

    def update(self, tenants: Iterable[Tenant]) -> None: ...


class QuotaExceeded(ResourceExhausted):
    """A tenant quota refused the request; `kind` names which one (a metrics label)."""

    def __init__(self, message: str, kind: str, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        # requests_per_s | tokens_per_s | tokens_burst | max_in_flight
        self.kind = kind


class TokenBucket:
    """Holds up to `burst` tokens, refilled continuously at `rate_per_s`."""

    def __init__(self, rate_per_s: float, burst: float, now_s: float) -> None:
        self._level = 0.0
        self._updated_s = now_s
        self.configure(rate_per_s, burst, now_s)
        self._level = burst  # a new tenant starts with a full burst

    def configure(self, rate_per_s: float, burst: float, now_s: float) -> None:
        """Change rate and burst, keeping the current level (capped at the new burst)."""
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
        if not burst > 0:
            raise ValueError(f"burst must be > 0, got {burst}")
        self._refill(now_s)
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._level = min(self._level, burst)

    def level(self, now_s: float) -> float:
        self._refill(now_s)
        return self._level

    def wait_s(self, amount: float, now_s: float) -> float:
        """Seconds until `amount` tokens are available; 0 when they are now."""
        self._refill(now_s)
        missing = amount - self._level
        # A billionth of a token is float rounding of the refill, not a real shortfall.
        return 0.0 if missing <= 1e-9 else missing / self.rate_per_s

    def take(self, amount: float, now_s: float) -> None:
        self._refill(now_s)
        self._level -= amount

    def give_back(self, amount: float, now_s: float) -> None:
        self._refill(now_s)
        self._level = min(self.burst, self._level + amount)

    def _refill(self, now_s: float) -> None:
        elapsed_s = now_s - self._updated_s
        if elapsed_s > 0:
            self._level = min(self.burst, self._level + elapsed_s * self.rate_per_s)
            self._updated_s = now_s


class _TenantState:
    def __init__(self, quota: TenantQuota, now_s: float) -> None:
        self.requests = TokenBucket(quota.requests_per_s, quota.requests_burst, now_s)
        self.tokens = TokenBucket(quota.tokens_per_s, quota.tokens_burst, now_s)
        self.max_in_flight = quota.max_in_flight
        self.num_in_flight = 0

    def configure(self, quota: TenantQuota, now_s: float) -> None:
        self.requests.configure(quota.requests_per_s, quota.requests_burst, now_s)
        self.tokens.configure(quota.tokens_per_s, quota.tokens_burst, now_s)
        self.max_in_flight = quota.max_in_flight


class QuotaLease:
    """One admitted request's hold on its tenant's quota; release exactly once."""

    def __init__(
        self, quotas: TenantQuotas, tenant_id: str, state: _TenantState, num_tokens_charged: int
    ) -> None:
        self._quotas = quotas
        self.tenant_id = tenant_id
        self._state = state
        self.num_tokens_charged = num_tokens_charged
        self.released = False

    def release(self, num_tokens_used: int | None = None) -> int:
        """End the request, settling its charge to what it used: charged tokens it did not use are
        refunded, and tokens used past the charge (a hold that was an estimate: a chat template's
        own tokens) are taken, the bucket going below zero if it must. Returns the refund.

        `num_tokens_used=None` means it used everything it was charged (no refund).
        A second call does nothing and returns 0, so error paths may call it freely.
        """
        if self.released:
            return 0
        self.released = True
        self._state.num_in_flight -= 1
        used = self.num_tokens_charged if num_tokens_used is None else max(0, num_tokens_used)
        refund = max(0, self.num_tokens_charged - used)
        if refund:
            self._state.tokens.give_back(refund, self._quotas.clock())
        elif used > self.num_tokens_charged:
            self._state.tokens.take(used - self.num_tokens_charged, self._quotas.clock())
        return refund


class TenantQuotas:
    """Quota state of every tenant, kept across config reloads."""

    def __init__(self, clock: Clock, *, in_flight_retry_after_s: float = 0.1) -> None:
        # An in-flight slot frees when some request ends, which no bucket predicts;
        # this is the hint given for that case.
        self.clock = clock
        self.in_flight_retry_after_s = in_flight_retry_after_s
        self._states: dict[str, _TenantState] = {}

    def update(self, tenants: Iterable[Tenant]) -> None:
        """Apply (re)loaded quotas. Existing tenants keep their bucket levels and in-flight counts;
        removed tenants are forgotten (their outstanding leases still release correctly)."""
        now_s = self.clock()
        fresh: dict[str, _TenantState] = {}
        for tenant in tenants:
            state = self._states.get(tenant.tenant_id)
            if state is None:
                state = _TenantState(tenant.quota, now_s)
            else:
                state.configure(tenant.quota, now_s)
            fresh[tenant.tenant_id] = state
        self._states = fresh

    def admit(self, tenant: Tenant, num_tokens: int = 0) -> QuotaLease:
        """Charge one request (and `num_tokens` tokens) or raise ResourceExhausted."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        state = self._state_of(tenant)
        now_s = self.clock()
        who = f"tenant '{tenant.tenant_id}'"
        if state.num_in_flight >= state.max_in_flight:
            raise QuotaExceeded(
                f"{who} has {state.num_in_flight} requests in flight (limit {state.max_in_flight})",
                "max_in_flight",
                retry_after_s=self.in_flight_retry_after_s,
            )
        if num_tokens > state.tokens.burst:
            # No wait would help, so no retry hint: the caller must ask for fewer tokens.
            raise QuotaExceeded(
                f"request needs {num_tokens} tokens (prompt + max_tokens) but {who} may use at most "
                f"{state.tokens.burst:g} at once; lower max_tokens",
                "tokens_burst",
            )
        request_wait_s = state.requests.wait_s(1, now_s)
        if request_wait_s > 0:
            raise QuotaExceeded(
                f"{who} is over its request rate quota ({state.requests.rate_per_s:g} requests/s, "
                f"burst {state.requests.burst:g}); retry after {request_wait_s:.3f} s",
                "requests_per_s",
                retry_after_s=request_wait_s,
            )
        token_wait_s = state.tokens.wait_s(num_tokens, now_s)
        if token_wait_s > 0:
            raise QuotaExceeded(
                f"{who} is over its token rate quota ({state.tokens.rate_per_s:g} tokens/s, "
                f"burst {state.tokens.burst:g}): request needs {num_tokens} tokens; "
                f"retry after {token_wait_s:.3f} s",
                "tokens_per_s",
                retry_after_s=token_wait_s,
            )
        state.requests.take(1, now_s)
        if num_tokens:
            state.tokens.take(num_tokens, now_s)
        state.num_in_flight += 1
        return QuotaLease(self, tenant.tenant_id, state, num_tokens)

    def num_in_flight(self, tenant_id: str) -> int:
        state = self._states.get(tenant_id)
        return 0 if state is None else state.num_in_flight

    def tokens_available(self, tenant_id: str) -> float:
        state = self._states.get(tenant_id)
        return 0.0 if state is None else state.tokens.level(self.clock())

    def _state_of(self, tenant: Tenant) -> _TenantState:
        state = self._states.get(tenant.tenant_id)
        if state is None:  # a tenant from a newer directory than the last update(); adopt it
            state = _TenantState(tenant.quota, self.clock())
            self._states[tenant.tenant_id] = state
        return state
