"""The gateway's own cap on requests in flight, across all tenants.

grpc.aio's `maximum_concurrent_rpcs` is not reliable for this, so the servicer
takes a permit first and answers UNAVAILABLE at once beyond the cap: another
gateway replica may have room, so a client (or balancer) should try elsewhere.
Not thread-safe by design: called from the gateway's one event loop.
"""

from __future__ import annotations

from services.common.errors import Unavailable


class ConcurrencyPermit:
    """One slot of the limit; release exactly once (extra releases are ignored)."""

    def __init__(self, limiter: ConcurrencyLimiter) -> None:
        self._limiter = limiter
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._limiter._num_in_flight -= 1

    def __enter__(self) -> ConcurrencyPermit:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class ConcurrencyLimiter:
    def __init__(self, max_in_flight: int, *, retry_after_s: float = 0.05) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self._num_in_flight = 0

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def utilization(self) -> float:
        """Fraction of the limit in use, [0, 1]; an input to load shedding."""
        return self._num_in_flight / self.max_in_flight

    def acquire(self) -> ConcurrencyPermit:
        if self._num_in_flight >= self.max_in_flight:
            raise Unavailable(
                f"gateway overloaded: {self._num_in_flight} requests in flight (limit {self.max_in_flight})",
                retry_after_s=self.retry_after_s,
            )
        self._num_in_flight += 1
        return ConcurrencyPermit(self)
