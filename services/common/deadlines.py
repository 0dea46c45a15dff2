"""The time a gRPC caller left for its call, read the same way at every hop."""

from __future__ import annotations

from typing import Protocol

# grpc reports a call without a deadline as a huge time remaining (or None, by version).
_NO_DEADLINE_S = 1e6


class HasTimeRemaining(Protocol):
    """What this needs of a grpc.aio.ServicerContext."""

    def time_remaining(self) -> float | None: ...


def remaining_s(context: HasTimeRemaining) -> float | None:
    """Seconds left before the caller's deadline; None when it set none."""
    return budget_s(context.time_remaining())


def budget_s(remaining: float | None) -> float | None:
    """A time budget as given (a gRPC deadline's remainder or a Submit entry's timeout); None for none."""
    if remaining is None or remaining > _NO_DEADLINE_S:
        return None
    return remaining
