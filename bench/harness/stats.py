"""Order statistics and ratios of a benchmark's figures, written once for every benchmark."""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1]): the smallest sample with at least q of them at or below it;
    NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is 0."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator
