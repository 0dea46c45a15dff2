"""Side-by-side comparison of two reports, with regression thresholds for CI gates.

A threshold reads METRIC=LIMIT:
    p99=10%            p99 latency may grow by at most 10% of the base value
    p99.9=25ms         ... by at most 25 ms
    throughput=5%      throughput may drop by at most 5%
    error_ratio=1%     ratios (error_ratio, goodput_ratio) move in percentage points: at most +1 point
Latency metrics: p50 p90 p99 p99.9 max mean, service_<p>, ttft_<p>, tpot_<p>, itl_<p>, e2e_<p>
(streams); rates: throughput goodput (req/s); ratios: goodput_ratio error_ratio.

Percentiles carry confidence intervals (the report's `ci_ms`, loadtest/confidence.py). When
both reports have one for a cell and the intervals overlap, the cell says "no change" and is
never a regression, whatever its threshold: the difference is within what resampling the same
run would give. Otherwise the cell gives the effect: the shift in ms and in percent.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtest.confidence import overlap
from loadtest.report_json import groups_of
from loadtest.tables import Table

_LATENCY_KEYS = ("p50", "p90", "p99", "p99.9", "max", "mean")
DEFAULT_METRICS = ("p50", "p99", "p99.9", "throughput", "goodput_ratio", "error_ratio")


@dataclass(frozen=True)
class Metric:
    name: str
    read: Callable[[dict], float | None]
    higher_is_worse: bool
    unit: str  # "ms", "rps" or "ratio"
    ci_path: tuple[str, str] | None = None  # (metric, percentile) under the group's ci_ms

    def read_ci(self, group: dict) -> tuple[float, float] | None:
        if self.ci_path is None:
            return None
        interval = (group.get("ci_ms") or {}).get(self.ci_path[0], {}).get(self.ci_path[1])
        return (interval[0], interval[1]) if isinstance(interval, list) and len(interval) == 2 else None


@dataclass(frozen=True)
class Threshold:
    metric: str
    limit: float  # a fraction (relative) or the metric's unit (absolute; ratios: a fraction)
    relative: bool

    def describe(self) -> str:
        return f"{self.metric}≤+{self.limit * 100:g}%" if self.relative else f"{self.metric}≤+{self.limit:g}"


@dataclass(frozen=True)
class Comparison:
    group: str
    metric: str
    base: float | None
    new: float | None
    regressed: bool
    gated: bool  # a threshold applied to this cell
    base_ci: tuple[float, float] | None = None
    new_ci: tuple[float, float] | None = None

    @property
    def no_change(self) -> bool:
        """Both intervals known and overlapping: the difference is noise."""
        return self.base_ci is not None and self.new_ci is not None and overlap(self.base_ci, self.new_ci)

    @property
    def effect(self) -> str:
        if self.no_change:
            return "no change"
        if self.base_ci is None or self.new_ci is None or self.base is None or self.new is None:
            return ""
        change = "" if self.change is None else f" ({self.change * 100:+.1f}%)"
        return f"{self.new - self.base:+.4g} ms{change}"

    @property
    def change(self) -> float | None:
        if self.base is None or self.new is None or self.base == 0:
            return None
        return (self.new - self.base) / self.base


def _at(*path: str) -> Callable[[dict], float | None]:
    def read(group: dict) -> float | None:
        node: object = group
        for key in path:
            if not isinstance(node, dict):
                return None
            node = node.get(key)
        return node if isinstance(node, int | float) else None
    return read


def _metrics() -> dict[str, Metric]:
    metrics = {k: Metric(k, _at("latency_ms", k), True, "ms", _ci_path("latency", k)) for k in _LATENCY_KEYS}
    sections = {"service": ("service_ms",), "ttft": ("stream", "ttft_ms"), "tpot": ("stream", "tpot_ms"),
                "itl": ("stream", "itl_ms"), "e2e": ("stream", "e2e_ms")}
    for prefix, path in sections.items():
        for k in _LATENCY_KEYS:
            metrics[f"{prefix}_{k}"] = Metric(f"{prefix}_{k}", _at(*path, k), True, "ms", _ci_path(prefix, k))
    metrics["throughput"] = Metric("throughput", _at("throughput_rps"), False, "rps")
    metrics["goodput"] = Metric("goodput", _at("goodput_rps"), False, "rps")
    metrics["goodput_ratio"] = Metric("goodput_ratio", _at("goodput_ratio"), False, "ratio")
    metrics["error_ratio"] = Metric("error_ratio", _at("error_ratio"), True, "ratio")
    return metrics


def _ci_path(metric: str, key: str) -> tuple[str, str] | None:
    return (metric, key) if key.startswith("p") else None  # mean and max have no interval


METRICS = _metrics()
_THRESHOLD = re.compile(r"^\s*([a-z0-9_.]+)\s*=\s*([0-9]*\.?[0-9]+)\s*(%|ms)?\s*$")


def parse_threshold(text: str) -> Threshold:
    match = _THRESHOLD.match(text)
    if not match:
        raise ValueError(f"threshold {text!r}: expected METRIC=N% or METRIC=N[ms], e.g. p99=10%")
    name, number, unit = match.group(1), float(match.group(2)), match.group(3)
    if name not in METRICS:
        raise ValueError(f"threshold {text!r}: unknown metric {name!r}; known: {', '.join(METRICS)}")
    metric = METRICS[name]
    if unit == "ms" and metric.unit != "ms":
        raise ValueError(f"threshold {text!r}: {name} is in {metric.unit}, not ms")
    if metric.unit == "ratio":
        # Ratios are already fractions: "1%" means one percentage point, absolute.
        return Threshold(name, number / 100 if unit == "%" else number, relative=False)
    return Threshold(name, number / 100 if unit == "%" else number, relative=unit == "%")


def is_regression(metric: Metric, threshold: Threshold, base: float, new: float) -> bool:
    worse_by = (new - base) if metric.higher_is_worse else (base - new)
    if threshold.relative:
        if base == 0:
            return worse_by > 0
        return worse_by / abs(base) > threshold.limit + 1e-12
    return worse_by > threshold.limit + 1e-12


def compare_reports(
    base: dict,
    new: dict,
    thresholds: Sequence[Threshold],
    groups: Sequence[str] | None = None,
    min_requests: int = 1,
    metrics: Sequence[str] = DEFAULT_METRICS,
) -> tuple[list[Comparison], list[str]]:
    """Cells for every shared group and metric (thresholded ones first, then `metrics`), and warnings."""
    base_groups, new_groups = groups_of(base), groups_of(new)
    wanted = list(groups) if groups else list(base_groups)
    warnings = [f"group {g!r} is missing from the new report" for g in wanted
                if g in base_groups and g not in new_groups]
    warnings += [f"group {g!r} is in neither report" for g in wanted if g not in base_groups and g not in new_groups]
    by_metric = {t.metric: t for t in thresholds}
    names = list(by_metric) + [m for m in metrics if m not in by_metric]
    cells = []
    for group in wanted:
        if group not in base_groups or group not in new_groups:
            continue
        b, n = base_groups[group], new_groups[group]
        enough = min(b["num_requests"], n["num_requests"]) >= min_requests
        if not enough:
            warnings.append(f"group {group!r} has fewer than {min_requests} requests; not gated")
        for name in names:
            metric = METRICS[name]
            bv, nv = metric.read(b), metric.read(n)
            if bv is None and nv is None:
                continue
            threshold = by_metric.get(name)
            gated = threshold is not None and enough
            cell = Comparison(group, name, bv, nv, False, gated, metric.read_ci(b), metric.read_ci(n))
            regressed = (threshold is not None and enough and bv is not None and not cell.no_change
                         and (nv is None or is_regression(metric, threshold, bv, nv)))
            cells.append(dataclasses.replace(cell, regressed=regressed))
    return cells, warnings


def comparison_table(cells: Sequence[Comparison], thresholds: Sequence[Threshold]) -> Table:
    limits = {t.metric: t.describe() for t in thresholds}
    rows = []
    for c in cells:
        change = "-" if c.change is None else f"{c.change * 100:+.1f}%"
        verdict = "REGRESSED" if c.regressed else ("ok" if c.gated else "")
        rows.append((c.group, c.metric, _fmt(c.base), _ci(c.base_ci), _fmt(c.new), _ci(c.new_ci), change, c.effect,
                     limits.get(c.metric, "") if c.gated else "", verdict))
    return Table("Comparison (base → new)", ("group", "metric", "base", "base CI", "new", "new CI", "change",
                                             "effect", "limit", "verdict"), tuple(rows),
                 "CI: 95% confidence interval of the percentile; effect: 'no change' when the intervals overlap "
                 "(never a regression), else the shift")


def _ci(interval: tuple[float, float] | None) -> str:
    return "-" if interval is None else f"[{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"
