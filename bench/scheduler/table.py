"""The scheduler benchmarks' table (benchmark, measured, ratio, target, met) and progress lines."""

from __future__ import annotations


def print_table(rows) -> None:
    headers = ("benchmark", "measured", "ratio", "target", "met")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def progress(message: str) -> None:
    print(f"  {message}", flush=True)
