"""Circuit breaker per scheduler endpoint.

CLOSED: calls flow; `num_consecutive_failures_to_open` failures in a row, or an
error rate of at least `error_rate_to_open` over `error_rate_window_s` (once
`min_calls_in_window` calls were seen), trip it OPEN. OPEN: calls fail fast
for `open_cooldown_s`. HALF_OPEN: up to `num_half_open_probes` calls go
through; a success closes the breaker, a failure re-opens it for another
cool-down.

Each call holds a `BreakerPermit` and reports its outcome through it. A permit
remembers the breaker's epoch (bumped on every state change), so the late
outcome of a call started before the last change cannot close or trip the
breaker by mistake.

What counts as a failure: UNAVAILABLE, INTERNAL, UNKNOWN, DATA_LOSS (the
endpoint is broken or unreachable). Not failures: RESOURCE_EXHAUSTED (a
healthy scheduler shedding load), DEADLINE_EXCEEDED (usually the client's
tight deadline; counting it would let one tenant trip the breaker for all),
and every answer about the request itself. CANCELLED means the client left:
no verdict.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.clock import Clock
from services.gateway.routing.sliding_window import SlidingWindowCounter
from services.gateway.upstream.status import UpstreamCode

_FAILURE_CODES = frozenset(
    {UpstreamCode.UNAVAILABLE, UpstreamCode.INTERNAL, UpstreamCode.UNKNOWN, UpstreamCode.DATA_LOSS}
)


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    num_consecutive_failures_to_open: int = 5
    error_rate_to_open: float = 0.5
    error_rate_window_s: float = 10.0
    min_calls_in_window: int = 20
    open_cooldown_s: float = 5.0
    num_half_open_probes: int = 1

    def __post_init__(self) -> None:
        if self.num_consecutive_failures_to_open < 1:
            raise ValueError(
                f"num_consecutive_failures_to_open must be >= 1, got {self.num_consecutive_failures_to_open}"
            )
        if not 0 < self.error_rate_to_open <= 1:
            raise ValueError(f"error_rate_to_open must be in (0, 1], got {self.error_rate_to_open}")
        if not self.error_rate_window_s > 0:
            raise ValueError(f"error_rate_window_s must be > 0, got {self.error_rate_window_s}")
        if self.min_calls_in_window < 1:
            raise ValueError(f"min_calls_in_window must be >= 1, got {self.min_calls_in_window}")
        if not self.open_cooldown_s > 0:
            raise ValueError(f"open_cooldown_s must be > 0, got {self.open_cooldown_s}")
        if self.num_half_open_probes < 1:
            raise ValueError(f"num_half_open_probes must be >= 1, got {self.num_half_open_probes}")


class BreakerPermit:
    """Leave to make one call; report its outcome once (later reports are ignored)."""

    def __init__(self, breaker: CircuitBreaker, epoch: int, is_probe: bool) -> None:
        self._breaker = breaker
        self._epoch = epoch
        self.is_probe = is_probe
        self.done = False

    def record(self, code: UpstreamCode) -> None:
        if code is UpstreamCode.CANCELLED:
            self.abandon()
        elif code in _FAILURE_CODES:
            self.failure()
        else:
            self.success()

    def success(self) -> None:
        if self._finish():
            self._breaker._on_success(self._epoch)

    def failure(self) -> None:
        if self._finish():
            self._breaker._on_failure(self._epoch)

    def abandon(self) -> None:
        """The call ended without telling anything about the endpoint."""
        self._finish()

    def _finish(self) -> bool:
        if self.done:
            return False
        self.done = True
        if self.is_probe:
            self._breaker._release_probe(self._epoch)
        return True


class CircuitBreaker:
    def __init__(self, endpoint: str, config: BreakerConfig, clock: Clock) -> None:
        self.endpoint = endpoint
        self.config = config
        self.clock = clock
        self._state = BreakerState.CLOSED
        self._epoch = 0
        self._opened_at_s = 0.0
        self._num_consecutive_failures = 0
        self._num_probes_in_flight = 0
        self._calls = SlidingWindowCounter(config.error_rate_window_s)
        self._failures = SlidingWindowCounter(config.error_rate_window_s)

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self.clock() - self._opened_at_s >= self.config.open_cooldown_s
        ):
            self._enter(BreakerState.HALF_OPEN)
        return self._state

    def is_available(self) -> bool:
        """Whether `try_acquire` would succeed now (no side effects beyond the cool-down check)."""
        state = self.state
        if state is BreakerState.OPEN:
            return False
        return state is BreakerState.CLOSED or self._num_probes_in_flight < self.config.num_half_open_probes

    def try_acquire(self) -> BreakerPermit | None:
        """A permit for one call, or None while the breaker refuses calls."""
        if not self.is_available():
            return None
        is_probe = self._state is BreakerState.HALF_OPEN
        if is_probe:
            self._num_probes_in_flight += 1
        return BreakerPermit(self, self._epoch, is_probe)

    def answered_poll(self) -> None:
        """The endpoint answered a health poll: an OPEN breaker lets a probe call through now,
        rather than at the end of its cool-down (a restarted scheduler is used again at once)."""
        if self.state is BreakerState.OPEN:
            self._enter(BreakerState.HALF_OPEN)

    def retry_after_s(self) -> float:
        """Time until the breaker lets a probe through; 0 unless OPEN."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._opened_at_s + self.config.open_cooldown_s - self.clock())

    def _on_success(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        if self._state is BreakerState.HALF_OPEN:
            self._enter(BreakerState.CLOSED)
            return
        self._num_consecutive_failures = 0
        self._calls.add(self.clock())

    def _on_failure(self, epoch: int) -> None:
        if epoch != self._epoch:
            return
        if self._state is BreakerState.HALF_OPEN:
            self._enter(BreakerState.OPEN)
            return
        now_s = self.clock()
        self._num_consecutive_failures += 1
        self._calls.add(now_s)
        self._failures.add(now_s)
        if (
            self._num_consecutive_failures >= self.config.num_consecutive_failures_to_open
            or self._error_rate_tripped(now_s)
        ):
            self._enter(BreakerState.OPEN)

    def _release_probe(self, epoch: int) -> None:
        if epoch == self._epoch:
            self._num_probes_in_flight -= 1

    def _error_rate_tripped(self, now_s: float) -> bool:
        num_calls = self._calls.total(now_s)
        if num_calls < self.config.min_calls_in_window:
            return False
        return self._failures.total(now_s) / num_calls >= self.config.error_rate_to_open

    def _enter(self, state: BreakerState) -> None:
        self._state = state
        self._epoch += 1
        self._num_probes_in_flight = 0
        if state is BreakerState.OPEN:
            self._opened_at_s = self.clock()
        if state is BreakerState.CLOSED:
            self._num_consecutive_failures = 0
            self._calls.reset()
            self._failures.reset()


class CircuitBreakers:
    """One breaker per endpoint, made on first use."""

    def __init__(self, config: BreakerConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._by_endpoint: dict[str, CircuitBreaker] = {}

    def for_endpoint(self, endpoint: str) -> CircuitBreaker:
        breaker = self._by_endpoint.get(endpoint)
        if breaker is None:
            breaker = self._by_endpoint[endpoint] = CircuitBreaker(endpoint, self.config, self.clock)
        return breaker

    def forget(self, endpoint: str) -> None:
        """`endpoint` left discovery for good: its breaker goes (a later return starts closed)."""
        self._by_endpoint.pop(endpoint, None)

    def states(self) -> dict[str, BreakerState]:
        """State per endpoint, for the breaker-state gauge."""
        return {endpoint: breaker.state for endpoint, breaker in self._by_endpoint.items()}
