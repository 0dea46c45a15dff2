"""A clock for logic tests: injected wherever code would read time, so tests never sleep."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class FakeClock:
    """Monotonic seconds that move only when a test says so. `sleep` stands in for asyncio.sleep
    in code that takes both: a sleeper wakes when `advance` carries the clock past its time."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s
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
        heapq.heappush(self._sleepers, (self.now_s + seconds, next(self._order), waiter))
        await waiter
