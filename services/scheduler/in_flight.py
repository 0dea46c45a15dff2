"""The calls a scheduler is serving (both transports), so a drain knows what to wait for and what
to hand over: classify calls are waited for, generate streams waited for up to the drain grace;
and the status a draining scheduler answers with."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from services.common.errors import Unavailable

T = TypeVar("T")
# Every refusal and handover of a draining scheduler starts so (gateways and tests match on it).
DRAINING = "scheduler draining:"


def draining_error(what_instead: str) -> Unavailable:
    """Pushback 0: no work was done (or the caller resumes the stream), so the gateway goes to
    another scheduler at once."""
    return Unavailable(f"{DRAINING} {what_instead}", retry_after_s=0.0)


class InFlightCalls(Generic[T]):
    def __init__(self) -> None:
        self.num_classify = 0
        self._streams: set[T] = set()
        self._changed = asyncio.Event()

    @property
    def streams(self) -> list[T]:
        return list(self._streams)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def classify_began(self) -> None:
        self.num_classify += 1

    def classify_ended(self) -> None:
        self.num_classify -= 1
        self._changed.set()

    def stream_began(self, stream: T) -> None:
        self._streams.add(stream)

    def stream_ended(self, stream: T) -> None:
        self._streams.discard(stream)
        self._changed.set()

    async def changed(self, timeout_s: float) -> None:
        """Returns when a call ends, or after timeout_s."""
        self._changed.clear()
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):  # not wait_for: it can swallow a cancellation on 3.11
                await self._changed.wait()
        except TimeoutError:
            pass


def idle(calls: InFlightCalls) -> bool:
    return calls.num_classify == 0 and calls.num_streams == 0

