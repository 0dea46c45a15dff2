"""Order statistics of a benchmark's samples, written once for every benchmark."""

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
