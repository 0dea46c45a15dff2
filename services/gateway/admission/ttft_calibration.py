"""How far the schedulers' TTFT predictions run from the TTFT measured, learned per (model, class) from served streams.

The schedulers predict a class's TTFT from their queues and a fitted step time (scheduler/latency_predictor.py),
and admission adds the streams it admitted since the last poll (routing/pressure.py). The model behind that is
simple and its bias depends on the regime, in both directions. Per stream, prediction against measurement
(bench_slo --streams-csv, 30 s windows): tinylm's batch class at 2x the peak was predicted 3.2 s at the median and
started in 0.8 s (refused while it would have met its 5 s target), the mock's at 4x predicted 4.7 s and started
in 18 s (admitted to miss it), tinylm's interactive class at 4x predicted 81 ms and started in 144 ms.

So admission multiplies each prediction by a factor learned from the streams it admitted: the mean log of measured
over predicted TTFT (a stream twice as slow and one twice as fast cancel out) per model and class, over about the
last MAX_WEIGHT streams, each stream's weight halving per half-life after it reported, and shrunk toward no
correction as if PRIOR_WEIGHT streams had measured exactly what was predicted. So while streams keep reporting the
factor follows them, and while none do it fades back toward 1: a class refused whole sends no samples, and a factor
that only fades lets it be tried again once the regime has changed. A stream that ended without a first token after
waiting longer than its corrected prediction teaches its wait as a lower bound (the worst misses would otherwise
never be seen). The factor is held within [MIN_FACTOR, MAX_FACTOR].

The same streams give the spread of that log ratio (their weighted variance, shrunk toward none as the mean is), so
a quantile of the TTFT is predicted too: `factor(..., quantile=0.9)` is exp(mean + 1.28 sd), a log-normal's 90th
percentile. Admission judges "will it meet its target" on such a quantile (the gateway's `--slo-admit-quantile`),
while the median is what it reports as the prediction: a stream predicted to start in 150 ms of its 200 ms target,
on a predictor whose streams spread 0.6-1.9x around it, misses one time in four or five, and admitting all of them
is what took the interactive class's tail at 2x the peak to the target itself (bench_slo, the mock: TTFT p99 at 2x
152 ms, 1.76x of 0.5x, with the median correction alone).

Pure: no clock, no metrics; the caller passes the time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from statistics import NormalDist

from services.common.priority import Priority

# Streams the mean covers at most: the newest ones while they come faster than they fade.
MAX_WEIGHT = 20.0
# Pseudo-streams that measured what was predicted: one stream alone moves the factor halfway to its ratio.
PRIOR_WEIGHT = 1.0
# A stream's weight halves per this many seconds, or per DECAY_TARGETS times its class's TTFT target if longer:
# a class's samples come back one TTFT after its admissions at the earliest.
HALF_LIFE_S = 2.0
DECAY_TARGETS = 1.0
MIN_FACTOR = 0.25
MAX_FACTOR = 4.0
# Predictions and measurements below this count as this (seconds): a ratio of two timer ticks means nothing.
FLOOR_S = 0.005
# Keys kept at most (model names come from clients; unknown ones share a label but not necessarily a key).
_MAX_KEYS = 10_000


@dataclass
class _Mean:
    """Weighted sums of log ratios and of their squares and the weight behind them, as of `taught_s`."""

    log_sum: float
    square_sum: float
    weight: float
    taught_s: float
    half_life_s: float

    def faded(self, now_s: float) -> tuple[float, float, float]:
        keep = 0.5 ** (max(0.0, now_s - self.taught_s) / self.half_life_s)
        return self.log_sum * keep, self.square_sum * keep, self.weight * keep


@functools.lru_cache(maxsize=8)
def _z(quantile: float) -> float:
    """A standard normal's `quantile` (configured once: cached off the per-stream path)."""
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    return NormalDist().inv_cdf(quantile)


def _bounded_exp(log_factor: float) -> float:
    return math.exp(min(max(log_factor, math.log(MIN_FACTOR)), math.log(MAX_FACTOR)))


class TtftCalibration:
    """The learned factor per (model, class)."""

    def __init__(self, *, half_life_s: float = HALF_LIFE_S, max_weight: float = MAX_WEIGHT) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        if not max_weight >= 1:
            raise ValueError(f"max_weight must be >= 1, got {max_weight}")
        self._half_life_s = half_life_s
        self._max_weight = max_weight
        self._means: dict[tuple[str, Priority], _Mean] = {}

    def factor(self, model: str, priority: Priority, now_s: float, quantile: float = 0.5) -> float:
        """What to multiply the class's predicted TTFT by now for its `quantile` (0.5: the median; 1: nothing
        learned, or all of it faded)."""
        return self.factors(model, priority, now_s, quantile)[1]

    def factors(self, model: str, priority: Priority, now_s: float, quantile: float) -> tuple[float, float]:
        """The median's factor and the `quantile`'s, from one look at the class (admission needs both per stream)."""
        z = _z(quantile)
        mean, sd = self._log_now((model, priority), now_s)
        return _bounded_exp(mean), _bounded_exp(mean + z * sd)

    def observe(self, model: str, priority: Priority, *, predicted_s: float, measured_s: float, target_s: float,
                now_s: float, censored: bool = False) -> None:
        """One stream admitted on `predicted_s` (the schedulers' prediction, before this correction) started after
        `measured_s`. `censored`: it ended without a first token after `measured_s`, so its TTFT was at least that;
        it teaches only when that is past what the correction predicts now."""
        if not (math.isfinite(predicted_s) and math.isfinite(measured_s)) or predicted_s < 0 or measured_s < 0:
            return
        key = (model, priority)
        sample = math.log(max(measured_s, FLOOR_S) / max(predicted_s, FLOOR_S))
        if censored and sample <= self._log_now(key, now_s)[0]:
            return  # it waited less than predicted: its TTFT could still have been anything
        mean = self._means.get(key)
        log_sum, square_sum, weight = (0.0, 0.0, 0.0) if mean is None else mean.faded(now_s)
        if weight > self._max_weight - 1:  # the oldest give way to the newest
            scale = (self._max_weight - 1) / weight
            log_sum, square_sum, weight = log_sum * scale, square_sum * scale, weight * scale
        if mean is None and len(self._means) >= _MAX_KEYS:
            self._means.clear()
        self._means[key] = _Mean(log_sum + sample, square_sum + sample * sample, weight + 1, now_s,
                                 max(self._half_life_s, DECAY_TARGETS * target_s))

    def _log_now(self, key: tuple[str, Priority], now_s: float) -> tuple[float, float]:
        """The mean and standard deviation of the log ratio now, both shrunk toward 0 by the prior."""
        mean = self._means.get(key)
        if mean is None:
            return 0.0, 0.0
        log_sum, square_sum, weight = mean.faded(now_s)
        if weight <= 0:
            return 0.0, 0.0
        variance = max(0.0, square_sum / weight - (log_sum / weight) ** 2) * weight / (weight + PRIOR_WEIGHT)
        return log_sum / (weight + PRIOR_WEIGHT), math.sqrt(variance)
