"""Calls grpc core has accepted but grpc.aio has not yet handed to a handler, and a drain that serves them.

grpc core queues each incoming call until grpc.aio asks it for the next one (one request per method
at a time, from the event loop). A loop short of CPU falls behind and the queue grows: under the
reliability tests' load a lone gateway's classify calls waited there up to 7.5 s, unseen by its
admission control. When the server stops, grpc core cancels every call still queued (CANCELLED,
grpc/grpc#41785), and no retry policy retries that. A drain therefore stops the server only once the
queue is empty: after the drain notice, clients that watch health send nothing new, so the calls
handed over since are that backlog, and when none has been handed over for a while, it is gone.

The queue itself cannot be read, so it is judged by its outflow: while it holds calls, each handover
re-arms the request that the next one is matched to, and handovers follow each other every few turns
of the event loop. Quiet is counted in polls of that same loop, not in seconds: a loop starved of
CPU runs neither the handovers nor the polls, and seconds passed meanwhile prove nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

# What a drain leaves of its grace to the calls running when it stops the server, however long the backlog took:
# the last calls handed over need about one call's time (a classify: well under a second, even on a starved box).
STOP_RESERVE_S = 1.0
POLL_S = 0.05
# Polls in a row with no call handed over: 4 x 50 ms, each at least one turn of the loop; a handover
# takes three or four turns (request completes, the serving loop's task, the call's task, the handler).
NUM_QUIET_POLLS = 4


@dataclass(frozen=True)
class BacklogServed:
    num_calls: int  # calls handed over while waiting
    waited_s: float
    quiet: bool  # False: calls were still being handed over when limit_s ran out


async def serve_backlog(num_handed: Callable[[], int], limit_s: float, *, poll_s: float = POLL_S,
                        num_quiet_polls: int = NUM_QUIET_POLLS, clock: Callable[[], float] = time.monotonic,
                        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> BacklogServed:
    """Until `num_quiet_polls` polls in a row see `num_handed()` unchanged, or `limit_s` has passed."""
    began = clock()
    first = last = num_handed()
    num_quiet = 0
    while num_quiet < num_quiet_polls:
        if clock() - began >= limit_s:
            return BacklogServed(num_handed() - first, clock() - began, quiet=False)
        await sleep(poll_s)
        now = num_handed()
        num_quiet = num_quiet + 1 if now == last else 0
        last = now
    return BacklogServed(last - first, clock() - began, quiet=True)
