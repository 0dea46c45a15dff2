"""When requests are sent: a piecewise-linear target rate and an arrival process.

Arrivals are drawn in "operational time", where the rate is 1 per unit, and
mapped back to wall time through the inverse of the cumulative rate
Lambda(t) = integral of rate. That one mechanism gives constant, Poisson and
gamma arrivals under constant, step and ramp schedules alike (the time-rescaling
theorem): a unit-rate Poisson process mapped through Lambda^-1 is a Poisson
process with the time-varying rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np


class ArrivalProcess(Enum):
    CONSTANT = "constant"  # evenly spaced
    POISSON = "poisson"  # exponential gaps, coefficient of variation 1
    GAMMA = "gamma"  # gamma gaps with shape = burstiness (1 is Poisson, < 1 burstier, > 1 smoother)


@dataclass(frozen=True)
class Segment:
    """The rate goes linearly from `from_value` to `to_value` over `duration_s` (equal: a step)."""

    duration_s: float
    from_value: float
    to_value: float

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"segment duration_s must be > 0, got {self.duration_s}")
        if self.from_value < 0 or self.to_value < 0:
            raise ValueError(f"segment rates must be >= 0, got {self.from_value} -> {self.to_value}")

    def value_at(self, tau_s: float) -> float:
        return self.from_value + (self.to_value - self.from_value) * tau_s / self.duration_s

    def integral_to(self, tau_s: float) -> float:
        slope = (self.to_value - self.from_value) / self.duration_s
        return self.from_value * tau_s + slope * tau_s * tau_s / 2

    def invert(self, amount: float) -> float:
        """The tau in [0, duration_s] where integral_to(tau) == amount."""
        slope = (self.to_value - self.from_value) / self.duration_s
        a = self.from_value
        # Root of slope/2 tau^2 + a tau - amount = 0, written so it is stable for slope -> 0 and a == 0.
        disc = max(0.0, a * a + 2 * slope * amount)
        denom = a + math.sqrt(disc)
        return min(self.duration_s, 2 * amount / denom) if denom > 0 else self.duration_s


class RateSchedule:
    """Contiguous segments starting at t = 0; also used for closed-loop concurrency levels."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        if not segments:
            raise ValueError("a schedule needs at least one segment")
        self.segments = tuple(segments)
        self._starts_s = np.cumsum([0.0] + [s.duration_s for s in self.segments])
        self._cumulative = np.cumsum([0.0] + [s.integral_to(s.duration_s) for s in self.segments])

    @classmethod
    def constant(cls, value: float, duration_s: float) -> RateSchedule:
        return cls([Segment(duration_s, value, value)])

    @property
    def duration_s(self) -> float:
        return float(self._starts_s[-1])

    @property
    def expected_total(self) -> float:
        return float(self._cumulative[-1])

    def value_at(self, t_s: float) -> float:
        index = self._segment_index(t_s)
        return self.segments[index].value_at(t_s - self._starts_s[index])

    def cumulative(self, t_s: float) -> float:
        """Expected arrivals in [0, t_s]."""
        t_s = min(max(t_s, 0.0), self.duration_s)
        index = self._segment_index(t_s)
        return float(self._cumulative[index] + self.segments[index].integral_to(t_s - self._starts_s[index]))

    def invert(self, amount: float) -> float | None:
        """The time at which `amount` arrivals are expected, or None past the end."""
        if amount > self._cumulative[-1]:
            return None
        index = int(np.searchsorted(self._cumulative, amount, side="right")) - 1
        index = min(index, len(self.segments) - 1)
        while index < len(self.segments) - 1 and self.segments[index].integral_to(self.segments[index].duration_s) == 0:
            index += 1  # a zero-rate segment holds no arrivals; skip over it
        rest = amount - self._cumulative[index]
        return float(self._starts_s[index] + self.segments[index].invert(rest))

    def _segment_index(self, t_s: float) -> int:
        index = int(np.searchsorted(self._starts_s, t_s, side="right")) - 1
        return min(max(index, 0), len(self.segments) - 1)


def unit_gaps(process: ArrivalProcess, rng: np.random.Generator, burstiness: float = 1.0) -> Iterator[float]:
    """Inter-arrival gaps with mean 1, drawn in blocks so long runs stay cheap."""
    if process is ArrivalProcess.GAMMA and not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    while True:
        match process:
            case ArrivalProcess.CONSTANT:
                block = np.ones(1024)
            case ArrivalProcess.POISSON:
                block = rng.exponential(1.0, 1024)
            case ArrivalProcess.GAMMA:
                block = rng.gamma(burstiness, 1.0 / burstiness, 1024)
        yield from block.tolist()


def arrival_times_s(
    schedule: RateSchedule,
    process: ArrivalProcess,
    rng: np.random.Generator,
    burstiness: float = 1.0,
) -> Iterator[float]:
    """Scheduled send times, seconds from the start, increasing, until the schedule ends."""
    amount = 0.0
    for gap in unit_gaps(process, rng, burstiness):
        amount += gap
        t_s = schedule.invert(amount)
        if t_s is None or t_s >= schedule.duration_s:
            return
        yield t_s
