"""The scheduler benchmarks' table (benchmark, measured, ratio, target, met) and progress lines."""

from __future__ import annotations

from bench.harness.tables import aligned_table


def print_table(rows) -> None:
    print(aligned_table(("benchmark", "measured", "ratio", "target", "met"), rows))


def progress(message: str) -> None:
    print(f"  {message}", flush=True)
