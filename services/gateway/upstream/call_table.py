"""Calls in flight on one multiplexed upstream stream: ids, handlers and deadlines.

The stream client names each call with an id unique for the stream's lifetime
(never reused, so a late reply cannot reach a newer call) and keeps each call's
deadline in one heap, so a single timer, armed for the earliest deadline, finds
every expired call. Finished calls leave their heap entries behind (removing from
the middle of a heap is O(n)); `next_deadline_s` skips them, and the heap is
rebuilt from the live calls when dead entries outnumber them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Generic, TypeVar

H = TypeVar("H")

# Dead heap entries tolerated before a rebuild: a rebuild costs O(live calls), so
# allowing a multiple of them keeps it amortized O(1) per call.
_MIN_DEAD_BEFORE_REBUILD = 64


class CallTable(Generic[H]):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._next_id = 1
        self._calls: dict[int, tuple[H, float]] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline_s, call_id), live or dead

    def __len__(self) -> int:
        return len(self._calls)

    def open(self, handler: H, timeout_s: float) -> int:
        """Registers a call that must finish within timeout_s from now; returns its id (>= 1)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        call_id = self._next_id
        self._next_id += 1
        deadline_s = self._clock() + timeout_s
        self._calls[call_id] = (handler, deadline_s)
        heapq.heappush(self._deadlines, (deadline_s, call_id))
        if len(self._deadlines) > 2 * len(self._calls) + _MIN_DEAD_BEFORE_REBUILD:
            self._rebuild()
        return call_id

    def get(self, call_id: int) -> H | None:
        found = self._calls.get(call_id)
        return None if found is None else found[0]

    def pop(self, call_id: int) -> H | None:
        """Forgets the call (it finished or was abandoned); None if it was not in flight."""
        found = self._calls.pop(call_id, None)
        return None if found is None else found[0]

    def deadline_s(self, call_id: int) -> float | None:
        found = self._calls.get(call_id)
        return None if found is None else found[1]

    def pop_expired(self) -> list[tuple[int, H]]:
        """Removes and returns the calls whose deadline has passed, earliest first."""
        now_s = self._clock()
        expired = []
        heap = self._deadlines
        while heap and heap[0][0] <= now_s:
            _, call_id = heapq.heappop(heap)
            found = self._calls.pop(call_id, None)
            if found is not None:
                expired.append((call_id, found[0]))
        return expired

    def next_deadline_s(self) -> float | None:
        """The earliest deadline of a call still in flight (None: no call)."""
        heap = self._deadlines
        while heap and heap[0][1] not in self._calls:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_all(self) -> list[tuple[int, H]]:
        """Removes every call (the stream broke)."""
        calls = [(call_id, handler) for call_id, (handler, _) in self._calls.items()]
        self._calls.clear()
        self._deadlines.clear()
        return calls

    def _rebuild(self) -> None:
        self._deadlines = [(deadline_s, call_id) for call_id, (_, deadline_s) in self._calls.items()]
        heapq.heapify(self._deadlines)
