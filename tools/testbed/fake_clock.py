"""A clock for logic tests: injected wherever code would read time, so tests never sleep."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class FakeClock:
    """Monotonic seconds that move only when a test says so. `sleep` stands in for asyncio.sleep
    in code that takes both: a sleeper wakes when `advance` carries the clock past its time.

    `autojump_turns`: a sleeper nobody wakes within that many event-loop turns moves the clock to its
    own time (as trio's MockClock autojump does), for tests that drive work, not time, and meet a
    short wait of the code's own (StepPacing.gather after an idle spell). None: only `advance` moves it."""

    def __init__(self, start_s: float = 1000.0, autojump_turns: int | None = None) -> None:
        self.now_s = start_s
        self.autojump_turns = autojump_turns
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now_s:
            _, _, waiter = heapq.heappop(self._sleepers)
            if not waiter.done():
                waiter.set_result(None)

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        wakes_at_s = self.now_s + seconds
        heapq.heappush(self._sleepers, (wakes_at_s, next(self._order), waiter))
        if self.autojump_turns is None:
            await waiter
            return
        for _ in range(self.autojump_turns):
            if waiter.done():
                return
            await asyncio.sleep(0)
        if not waiter.done():
            self.advance(max(0.0, wakes_at_s - self.now_s))
        await waiter
