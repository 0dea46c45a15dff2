"""One version's requests over one rollout step: what the canary analysis compares.

A window counts outcomes and keeps latency samples (end to end and per stage) up to a cap,
by reservoir sampling past it, so memory stays bounded however long a step runs and the
samples stay a fair draw of the whole step. Shadow comparisons (agreed or not) land in the
canary's window.

Which final codes count as what (the version's fault, not the caller's):
  errors          INTERNAL, UNKNOWN, UNAVAILABLE, DATA_LOSS, RESOURCE_EXHAUSTED
                  (upstream: a version too slow fills its queue)
  deadline misses DEADLINE_EXCEEDED
  neither         OK, and the caller's own mistakes or choices (INVALID_ARGUMENT, CANCELLED, ...)
Latency samples are of OK requests only.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass, field

MAX_SAMPLES = 5000
ERROR_CODES = frozenset({"INTERNAL", "UNKNOWN", "UNAVAILABLE", "DATA_LOSS", "RESOURCE_EXHAUSTED"})
DEADLINE_CODE = "DEADLINE_EXCEEDED"
END_TO_END = "end_to_end"


@dataclass
class _Reservoir:
    values: list[float] = field(default_factory=list)
    num_seen: int = 0

    def add(self, value: float, rng: random.Random) -> None:
        self.num_seen += 1
        if len(self.values) < MAX_SAMPLES:
            self.values.append(value)
            return
        slot = rng.randrange(self.num_seen)
        if slot < MAX_SAMPLES:
            self.values[slot] = value


@dataclass
class Window:
    """A version's outcomes since its step began."""

    num_requests: int = 0
    num_errors: int = 0
    num_deadline_misses: int = 0
    # Shadow comparisons with the baseline's answer for the same request.
    num_compared: int = 0
    num_agreed: int = 0
    # Latency samples: END_TO_END and "<service>.<stage>" -> seconds.
    _latencies: dict[str, _Reservoir] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    def record(self, code: str, duration_s: float, stages_s: Iterable[tuple[str, float]] = ()) -> None:
        self.num_requests += 1
        if code in ERROR_CODES:
            self.num_errors += 1
        elif code == DEADLINE_CODE:
            self.num_deadline_misses += 1
        if code != "OK":
            return
        self._add(END_TO_END, duration_s)
        for stage, seconds in stages_s:
            self._add(stage, seconds)

    def compared(self, agreed: bool) -> None:
        self.num_compared += 1
        self.num_agreed += int(agreed)

    def latencies(self, name: str = END_TO_END) -> list[float]:
        reservoir = self._latencies.get(name)
        return reservoir.values if reservoir is not None else []

    def latency_names(self) -> list[str]:
        return sorted(self._latencies)

    def _add(self, name: str, seconds: float) -> None:
        reservoir = self._latencies.get(name)
        if reservoir is None:
            reservoir = self._latencies[name] = _Reservoir()
        reservoir.add(seconds, self._rng)
