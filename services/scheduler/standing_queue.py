"""Standing-queue detection for a batcher's queue, CoDel-style (Nichols & Jacobson).

A queue that drains between bursts is good queue: it absorbs bursts and forms
batches. A queue whose *shortest* wait over a whole interval stays above the
target never drains: every request pays that wait and nothing is gained. This
module only watches: it is fed the waits of dispatched items and says whether
the queue is standing now. The batcher acts on it with adaptive LIFO, as in
Facebook's "Fail at scale" queue discipline: serve the newest first, which still
have the most time left, so the served ones keep making their deadlines while the
oldest run into theirs; an item that waited `aging_s` goes first, so none starves.

    standing = (min over the last full interval of the oldest item's wait at each dispatch) > target

(The oldest item's wait, not the served item's: once the newest are served first,
their short waits would hide the backlog behind them.)

The target is a floor plus what a batching queue needs anyway: the time of one
batch (an item arriving just after a batch left waits for the next).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StandingQueueConfig:
    # CoDel's target: waits up to this (plus one batch time) are the good queue.
    target_s: float = 0.005
    # The queue must stay above the target this long, at its shortest, to count as standing.
    interval_s: float = 0.1
    # While standing, an item that waited this long is served before newer ones (nothing starves).
    aging_s: float = 0.5

    def __post_init__(self) -> None:
        if self.target_s < 0:
            raise ValueError(f"target_s must be >= 0, got {self.target_s}")
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if not self.aging_s > 0:
            raise ValueError(f"aging_s must be > 0, got {self.aging_s}")


class StandingQueue:
    def __init__(self, config: StandingQueueConfig, start_s: float) -> None:
        self.config = config
        self.standing = False
        self._interval_start_s = start_s
        self._min_wait_s = math.inf

    def on_dispatch(self, wait_s: float, batch_time_s: float, now_s: float) -> None:
        """A batch is leaving a queue whose oldest item (served or still waiting) has waited `wait_s`;
        `batch_time_s`: the batch time estimate."""
        self._min_wait_s = min(self._min_wait_s, wait_s)
        self._close_interval(batch_time_s, now_s)

    def on_empty(self, now_s: float) -> None:
        """The queue drained: by definition not standing."""
        self.standing = False
        self._interval_start_s = now_s
        self._min_wait_s = math.inf

    def good_wait_s(self, batch_time_s: float) -> float:
        """The longest wait in a queue that still drains: the target plus one batch time."""
        return self.config.target_s + batch_time_s

    def stood_wait_s(self, batch_time_s: float) -> float:
        """A wait of the oldest item of a FIFO (sub)queue beyond which that queue has not drained
        for a whole interval: it stands on its own, not only inside a standing queue."""
        return self.good_wait_s(batch_time_s) + self.config.interval_s

    def _close_interval(self, batch_time_s: float, now_s: float) -> None:
        if now_s - self._interval_start_s < self.config.interval_s:
            return
        self.standing = self._min_wait_s > self.good_wait_s(batch_time_s)
        self._interval_start_s = now_s
        self._min_wait_s = math.inf
