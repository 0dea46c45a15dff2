"""Holding calls while no scheduler can take them, until one can or their deadline says stop (issue 35).

When every scheduler is unavailable at once (every circuit open, every one gone, restarting, draining
or not serving the model yet), failing a call that still has seconds of deadline fails a call that
could succeed. The dispatcher holds it instead (dispatcher.py `_hold`) and sends it again as soon as
a scheduler can take it: what Envoy does with a request waiting for a healthy host, within its timeout.

What is held: idempotent calls (classify, KServe ModelInfer) and Generate streams (sent again whole
before their first token, resumed as a continuation after it: stream_resume.py), after a failure
that proves no scheduler could take the call: the endpoint was gone, draining, silent or not serving
the model, or no endpoint may be called at all. A live scheduler's refusal ("no worker", overloaded,
a bad request) is not held: it stays an ordinary retry, paid from the retry budget.

When a held call goes: only on `wake(model)`, which says that a scheduler can take the model's calls
now: one answered a poll with the model ready (routing/pressure_poller.py), or one served a call of
it. Nothing is re-sent on a timer to schedulers that said nothing, so a dead replica set sees no more
calls from the hold than from new traffic, and the retry budget keeps bounding the retries.

What bounds it:
* the deadline: a call is held only while its deadline leaves `margin_s` (HOLD_MARGIN_S, the hop's,
  and the model's minimum service time) to finish in; then it fails DEADLINE_EXCEEDED, saying how
  long it was held;
* the cap: at most `max_held` calls wait at once; beyond it a call fails as it did before (its
  UNAVAILABLE, saying that the hold is full);
* per call, HOLD_BACKOFF_S: a call that went out and found no scheduler again waits a little
  longer before its next try, however often wakes come.

Cancellation (the client left) ends the wait at once and frees its place. Not thread-safe: the
gateway's one event loop calls it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from services.gateway.telemetry import metrics

# The n-th wait of one call (n from 0) lasts at least this long.
HOLD_BACKOFF_S = (0.0, 0.1, 0.2, 0.4, 0.8, 1.0)
# Kept back from the deadline besides the hop margin and the model's minimum service time.
HOLD_MARGIN_S = 0.05
DEFAULT_MAX_HELD = 512

# (event, timeout_s) -> whether the event was set before the timeout.
Waiter = Callable[[asyncio.Event, float], Awaitable[bool]]


async def wait_for_event(event: asyncio.Event, timeout_s: float) -> bool:
    # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that lands as the event is
    # set (CPython gh-86296), and a client's cancel must end the hold.
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return False
    return True


class HoldFull(Exception):
    """The hold has `max_held` calls waiting already."""


class CallHold:
    def __init__(self, max_held: int = DEFAULT_MAX_HELD, *, wait: Waiter = wait_for_event,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        if max_held < 0:
            raise ValueError(f"max_held must be >= 0, got {max_held}")
        self.max_held = max_held
        self.num_held = 0
        self._wait = wait
        self._sleep = sleep
        # model -> the event its held calls wait on; set and dropped by wake(). One per model
        # held at some point (the dispatcher holds only models the gateway knows).
        self._woken: dict[str, asyncio.Event] = {}

    @property
    def enabled(self) -> bool:
        return self.max_held > 0

    @property
    def full(self) -> bool:
        return self.num_held >= self.max_held

    def wake(self, models: Iterable[str]) -> None:
        """A scheduler can take these models' calls now: their held calls go (after their backoff)."""
        if not self.num_held:
            return
        for model in models:
            woken = self._woken.pop(model, None)
            if woken is not None:
                woken.set()

    async def wait(self, model: str, *, num_waits: int, max_wait_s: float, label: str = "") -> bool:
        """Holds one call of `model` for at most `max_wait_s`: until a wake of it, and at least its
        backoff (this is the call's `num_waits`-th wait). True when woken, False when the time ran out.

        Raises HoldFull at once when `max_held` calls wait already. `label`: the model's metric label."""
        if self.full:
            raise HoldFull(self.max_held)
        woken = self._woken.setdefault(model, asyncio.Event())  # a wake during the backoff counts
        gauge = metrics.HELD_REQUESTS.labels(label or model)
        self.num_held += 1
        gauge.inc()
        try:
            backoff_s = min(HOLD_BACKOFF_S[min(num_waits, len(HOLD_BACKOFF_S) - 1)], max_wait_s)
            if backoff_s > 0:
                await self._sleep(backoff_s)
            if woken.is_set():
                return True
            return await self._wait(woken, max_wait_s - backoff_s)
        finally:
            self.num_held -= 1
            gauge.dec()
