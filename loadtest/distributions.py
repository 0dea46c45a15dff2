"""Integer length distributions for prompts, outputs and image sizes.

A scenario writes either a plain integer (fixed) or a mapping with `dist`:

    {dist: fixed, value: 16}
    {dist: uniform, min: 8, max: 32}                     # inclusive bounds
    {dist: normal, mean: 20, std: 5, min: 1, max: 64}    # clipped to [min, max]
    {dist: lognormal, median: 20, sigma: 0.5, min: 1, max: 256}
    {dist: choice, values: [8, 64], weights: [3, 1]}
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np


class DistKind(Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    NORMAL = "normal"
    LOGNORMAL = "lognormal"
    CHOICE = "choice"


@dataclass(frozen=True)
class IntDist:
    kind: DistKind
    low: int  # smallest value ever drawn
    high: int  # largest value ever drawn
    center: float = 0.0  # mean (normal) or median (lognormal)
    spread: float = 0.0  # std (normal) or sigma of log (lognormal)
    values: tuple[int, ...] = ()
    weights: tuple[float, ...] = ()

    def sample(self, rng: np.random.Generator) -> int:
        match self.kind:
            case DistKind.FIXED:
                return self.low
            case DistKind.UNIFORM:
                return int(rng.integers(self.low, self.high + 1))
            case DistKind.NORMAL:
                raw = rng.normal(self.center, self.spread)
            case DistKind.LOGNORMAL:
                raw = self.center * np.exp(rng.normal(0.0, self.spread))
            case DistKind.CHOICE:
                return int(rng.choice(self.values, p=self.weights))
        return int(np.clip(round(raw), self.low, self.high))

    @property
    def mean_estimate(self) -> float:
        """Rough mean, for planning (e.g. expected output tokens); exact for fixed/uniform/choice."""
        match self.kind:
            case DistKind.FIXED:
                return float(self.low)
            case DistKind.UNIFORM:
                return (self.low + self.high) / 2
            case DistKind.CHOICE:
                return float(np.dot(self.values, self.weights))
            case DistKind.NORMAL:
                return float(np.clip(self.center, self.low, self.high))
            case DistKind.LOGNORMAL:
                return float(np.clip(self.center * np.exp(self.spread**2 / 2), self.low, self.high))


def fixed(value: int) -> IntDist:
    return IntDist(DistKind.FIXED, value, value)


def parse_int_dist(raw: Any, field: str, *, minimum: int = 1) -> IntDist:
    """Parses a scenario length field; `field` names it in error messages."""
    if isinstance(raw, bool) or raw is None:
        raise ValueError(f"{field}: expected an integer or a {{dist: ...}} mapping, got {raw!r}")
    if isinstance(raw, int):
        _check_min(raw, minimum, field)
        return fixed(raw)
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: expected an integer or a {{dist: ...}} mapping, got {raw!r}")
    try:
        kind = DistKind(raw.get("dist"))
    except ValueError:
        names = ", ".join(k.value for k in DistKind)
        raise ValueError(f"{field}.dist must be one of {names}, got {raw.get('dist')!r}") from None
    dist = _build(kind, raw, field)
    _check_min(dist.low, minimum, f"{field} lower bound")
    if dist.high < dist.low:
        raise ValueError(f"{field}: max ({dist.high}) must be >= min ({dist.low})")
    return dist


def _build(kind: DistKind, raw: dict, field: str) -> IntDist:
    def need(key: str) -> Any:
        if key not in raw:
            raise ValueError(f"{field}: dist {kind.value} needs {key!r}")
        return raw[key]

    match kind:
        case DistKind.FIXED:
            value = int(need("value"))
            return fixed(value)
        case DistKind.UNIFORM:
            return IntDist(kind, int(need("min")), int(need("max")))
        case DistKind.NORMAL:
            std = float(need("std"))
            if std < 0:
                raise ValueError(f"{field}: std must be >= 0, got {std}")
            return IntDist(kind, int(need("min")), int(need("max")), float(need("mean")), std)
        case DistKind.LOGNORMAL:
            median, sigma = float(need("median")), float(need("sigma"))
            if median <= 0 or sigma < 0:
                raise ValueError(f"{field}: lognormal needs median > 0 and sigma >= 0, got {median}, {sigma}")
            return IntDist(kind, int(need("min")), int(need("max")), median, sigma)
        case DistKind.CHOICE:
            values = tuple(int(v) for v in need("values"))
            if not values:
                raise ValueError(f"{field}: choice needs at least one value")
            weights = tuple(float(w) for w in raw.get("weights", [1.0] * len(values)))
            if len(weights) != len(values) or any(w < 0 for w in weights) or sum(weights) <= 0:
                raise ValueError(f"{field}: weights must be {len(values)} non-negative numbers with a positive sum")
            total = sum(weights)
            return IntDist(kind, min(values), max(values), values=values, weights=tuple(w / total for w in weights))


def _check_min(value: int, minimum: int, field: str) -> None:
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
