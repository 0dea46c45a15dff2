"""The overload benchmark's table: run results (bench_overload's JSON shape) in, Markdown rows out.

Pure: no grpc, no processes. Ratio rows show every run's figure and their median; the coverage
and generator-lag columns belong to the window the figure came from (the flooded one for a
ratio, the alone one for an "alone -> flooded" row), one entry per run.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable

from bench.harness.tables import aligned_table

MULTIPLES = (1.0, 2.0, 4.0)
TARGETS = {"peak": ">= 1.3x today's", "2x": ">= 0.90", "4x": ">= 0.75", "flood": "<= 2x",
           "fairness": "<= 3x", "lone": "<= 4 ms", "coverage": ">= 95%"}


def medians(runs: list[dict]) -> dict:
    """Per-figure medians over runs of the headline numbers the table shows."""

    def med(path: Callable[[dict], float]) -> float:
        values = [path(r) for r in runs if _has(r, path)]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    return {
        "peak_per_s": med(lambda r: r["peak"]["peak_per_s"]),
        **{f"{m:g}x": med(lambda r, m=m: r["multiples"][f"{m:g}x"]["fraction_of_peak"]) for m in MULTIPLES},
        "flood_ratio": med(lambda r: r["flood"]["p99_ratio"]),
        "critical_ttft_ratio": med(lambda r: r["generate"]["critical"]["ttft_p99_ratio"]),
        "fairness_ttft_ratio": med(lambda r: r["generate"]["fairness"]["ttft_p99_ratio"]),
        "lone_p50_ms": med(lambda r: r["lone"]["p50_ms"]),
    }


def _has(run: dict, path: Callable[[dict], float]) -> bool:
    try:
        path(run)
    except (KeyError, TypeError):
        return False
    return True


def table_rows(runs: list[dict]) -> list[tuple[str, ...]]:
    """(figure, every run, median, target, coverage p50/p99 per run, lag p99 per run) rows for the parts
    every run has."""
    rows = []

    def row(figure: str, values: list[float], fmt: str, target: str, sections: list[dict]) -> None:
        shown = ", ".join(fmt.format(v) for v in values)
        median = fmt.format(statistics.median(values)) if values else "-"
        coverage = ", ".join(f"{_pct(s.get('coverage_p50'))}/{_pct(s.get('coverage_p99'))}" for s in sections)
        lag = ", ".join(f"{s.get('lag_p99_ms', math.nan):.1f}{' BEHIND' if s.get('generator_fell_behind') else ''}"
                        for s in sections)
        rows.append((figure, shown, median, target, coverage, lag))

    if all("peak" in r for r in runs):
        row("peak goodput (ok <= 100 ms)/s", [r["peak"]["peak_per_s"] for r in runs], "{:.0f}", TARGETS["peak"],
            [r["peak"]["best"] for r in runs])
    if all("multiples" in r for r in runs):
        for m in MULTIPLES:
            key = f"{m:g}x"
            row(f"goodput at {key} peak / peak", [r["multiples"][key]["fraction_of_peak"] for r in runs], "{:.2f}",
                TARGETS.get(key, "-"), [r["multiples"][key] for r in runs])
    if all("flood" in r for r in runs):
        row("flood: A p99 with B at 10x quota / alone", [r["flood"]["p99_ratio"] for r in runs], "{:.2f}",
            TARGETS["flood"], [r["flood"]["flooded"] for r in runs])
        row("  A p99 alone, ms", [r["flood"]["alone"]["p99_ms"] for r in runs], "{:.1f}", "-",
            [r["flood"]["alone"] for r in runs])
        row("  A p99 flooded, ms", [r["flood"]["flooded"]["p99_ms"] for r in runs], "{:.1f}", "-",
            [r["flood"]["flooded"] for r in runs])
    if all("generate" in r for r in runs):
        row("generate capacity, streams/s", [r["generate"]["capacity"]["streams_per_s"] for r in runs], "{:.1f}",
            "-", [])
        for name, label, target in (("critical", "critical TTFT p99, sheddable at 2x cap / alone", "(info)"),
                                    ("fairness", "light TTFT p99, same-class heavy at 2x cap / alone",
                                     TARGETS["fairness"])):
            g = [r["generate"][name] for r in runs]
            row(label, [p["ttft_p99_ratio"] for p in g], "{:.2f}", target, [p["flooded"] for p in g])
            for metric in ("ttft", "e2e"):
                rows.append(_before_after(f"  {metric} p99 alone -> flooded, ms", g, f"{metric}_p99_ms"))
    if all("lone" in r for r in runs):
        row("lone request p50 at 20/s, ms", [r["lone"]["p50_ms"] for r in runs], "{:.2f}", TARGETS["lone"],
            [r["lone"] for r in runs])
    return rows


def _before_after(figure: str, parts: list[dict], key: str) -> tuple[str, ...]:
    """A row of `alone -> flooded` values per run and of their medians."""
    alone, flooded = [p["alone"][key] for p in parts], [p["flooded"][key] for p in parts]
    shown = ", ".join(f"{a:.0f} -> {f:.0f}" for a, f in zip(alone, flooded, strict=True))
    median = f"{statistics.median(alone):.0f} -> {statistics.median(flooded):.0f}"
    return (figure, shown, median, "-", ", ".join(f"{_pct(p['alone'].get('coverage_p50'))}/"
                                                  f"{_pct(p['alone'].get('coverage_p99'))}" for p in parts),
            ", ".join(f"{p['alone']['lag_p99_ms']:.1f}{' BEHIND' if p['alone']['generator_fell_behind'] else ''}"
                      for p in parts))


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.0f}%"


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    return aligned_table(("figure", "every run", "median", "target", "coverage p50/p99", "gen lag p99 ms"), rows)


def noise_line(runs: list[dict]) -> str:
    loads = [p["load_average_1m"] for r in runs for p in r.values()]
    return (f"load average (1 min) at each part's start: {min(loads):.2f}-{max(loads):.2f} on {os.cpu_count()} cores"
            if loads else "")



