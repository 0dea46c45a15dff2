"""A clock for logic tests: injected wherever code would read time, so tests never sleep."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
