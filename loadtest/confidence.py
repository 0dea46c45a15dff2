"""Bootstrap confidence intervals for percentiles, computed exactly rather than by resampling.

The percentile bootstrap resamples the n measured values with replacement and reads the
p-th percentile of each resample. Its distribution has a closed form, so no resampling is
needed (and no resampling noise enters the report): with the values sorted, x_(1) <= ... <= x_(n),
and the percentile taken as the smallest value with at least m = ceil(p n) values at or below
it, a resample's percentile is at most x_(j) exactly when at least m of its n draws fall at or
below x_(j), and each draw does with probability j / n:

    P(Q* <= x_(j)) = P(Binomial(n, j / n) >= m)

The interval is [x_(lo), x_(hi)] with lo the first j where that reaches (1 - confidence) / 2
and hi the first where it reaches (1 + confidence) / 2: what B -> infinity resamples would give.
Few values give wide intervals, as they should (the p99.9 of 100 values spans up to the max).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

CONFIDENCE = 0.95
METHOD = "percentile bootstrap, exact (binomial order statistics)"
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99.9": 99.9}


def percentile_interval(sorted_values: np.ndarray, percentile: float,
                        confidence: float = CONFIDENCE) -> tuple[float, float]:
    """[low, high] for the `percentile` (0..100) of `sorted_values` (ascending, non-empty)."""
    # scipy.special, not scipy.stats (whose import takes seconds): bdtrc(k, n, p) = P(Binomial(n, p) > k).
    # Imported here: only reports need it. No stubs (scipy-stubs is not pinned).
    from scipy.special import bdtrc  # type: ignore[import-untyped]

    n = len(sorted_values)
    if n == 0:
        raise ValueError("no values: a percentile needs at least one")
    m = max(1, math.ceil(percentile / 100 * n - 1e-9))
    j = np.arange(1, n + 1)
    at_most = bdtrc(m - 1, n, j / n)  # P(Q* <= x_(j)), non-decreasing in j; 1 at j = n
    tail = (1 - confidence) / 2
    lo = int(np.searchsorted(at_most, tail, side="left"))
    hi = int(np.searchsorted(at_most, 1 - tail, side="left"))
    return float(sorted_values[min(lo, n - 1)]), float(sorted_values[min(hi, n - 1)])


def percentile_intervals_ms(values_us: Iterable[float], confidence: float = CONFIDENCE) -> dict[str, list[float]]:
    """{"p50": [low_ms, high_ms], ...}; empty when there are no values."""
    ordered = np.sort(np.fromiter(values_us, dtype=np.float64))
    if len(ordered) == 0:
        return {}
    return {key: [round(low / 1000, 3), round(high / 1000, 3)]
            for key, p in PERCENTILES.items()
            for low, high in [percentile_interval(ordered, p, confidence)]}


def overlap(a: list[float] | tuple[float, float], b: list[float] | tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]
