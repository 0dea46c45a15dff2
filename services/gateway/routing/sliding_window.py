"""A counter summed over the last `window_s` seconds, kept in fixed time slices.

Used by the retry budget (requests and retries per upstream) and the circuit
breaker (calls and failures per endpoint). Memory and time per call are
O(num_slots) at worst, independent of the request rate.

The window slides one slice at a time, so `total()` covers between
`window_s - slice_s` and `window_s` seconds of history: the usual trade of
Finagle's WindowedAdder and Hystrix's rolling counters.
"""

from __future__ import annotations

import math


class SlidingWindowCounter:
    def __init__(self, window_s: float, num_slots: int = 10) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.window_s = window_s
        self._slot_s = window_s / num_slots
        self._slots = [0.0] * num_slots
        self._head: int | None = None  # absolute index of the newest slice written to

    def add(self, now_s: float, amount: float = 1.0) -> None:
        head = self._advance(now_s)
        self._slots[head % len(self._slots)] += amount

    def total(self, now_s: float) -> float:
        self._advance(now_s)
        return sum(self._slots)

    def reset(self) -> None:
        self._slots = [0.0] * len(self._slots)
        self._head = None

    def _advance(self, now_s: float) -> int:
        """Moves the head to now_s's slice (clearing the slices passed); returns the head."""
        index = math.floor(now_s / self._slot_s)
        if self._head is None:
            self._head = index
            return index
        if index <= self._head:  # same slice, or a clock that stepped back: keep counting here
            return self._head
        num_expired = min(index - self._head, len(self._slots))
        for step in range(1, num_expired + 1):
            self._slots[(self._head + step) % len(self._slots)] = 0.0
        self._head = index
        return index
