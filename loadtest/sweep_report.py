"""Renders a sweep document: terminal/Markdown table and an HTML page with the knee plot."""

from __future__ import annotations

import html

from matplotlib.figure import Figure

from loadtest.report_html import STYLE, plain_log_ticks, png_base64
from loadtest.tables import Table


def sweep_table(doc: dict) -> Table:
    rows = []
    for step in doc["steps"]:
        o = step["overall"]
        lat = o["latency_ms"]
        rows.append((f"{step['rate_rps']:g}", "pass" if step["passed"] else "FAIL", f"{o['throughput_rps']:.1f}",
                     f"{o['goodput_ratio'] * 100:.1f}%", f"{o['error_ratio'] * 100:.1f}%",
                     _f(lat.get("p50")), _f(lat.get("p99")), o["tail_top_stage"] or "-", "; ".join(step["reasons"])))
    return Table("Sweep (latency ms)", ("offered/s", "verdict", "thr/s", "good%", "err%", "p50", "p99",
                                        "tail owner", "why"), tuple(rows))


def knee_line(doc: dict) -> str:
    crit = doc["meta"]["criteria"]
    what = f"goodput ≥ {crit['min_goodput_ratio']:.1%} per class, errors ≤ {crit['max_error_ratio']:.1%}"
    if doc["knee_rps"] is None:
        return f"knee: none — the SLO ({what}) broke at the first rate tried"
    if doc["reached_max_rps"]:
        return f"knee: ≥ {doc['knee_rps']:g} req/s — SLO ({what}) held up to the sweep's max rate"
    return f"knee: {doc['knee_rps']:g} req/s (max rate at SLO: {what}); broke at {doc['first_failing_rps']:g} req/s"


def sweep_text(doc: dict) -> str:
    return f"sweep · {doc['meta']['name']} → {doc['meta']['target']}\n\n{sweep_table(doc).to_text()}\n\n{knee_line(doc)}\n"


def sweep_markdown(doc: dict) -> str:
    return f"# Sweep: {doc['meta']['name']}\n\n**{knee_line(doc)}**\n\n{sweep_table(doc).to_markdown()}\n"


def sweep_html(doc: dict) -> str:
    steps = doc["steps"]
    fig = Figure(figsize=(10, 4))
    left, right = fig.subplots(1, 2)
    rates = [s["rate_rps"] for s in steps]
    classes = sorted({name for s in steps for name in s["classes"]})
    for i, name in enumerate(classes):
        points = [(s["rate_rps"], s["classes"][name]["latency_ms"].get("p99")) for s in steps if name in s["classes"]]
        points = [(r, v) for r, v in points if v is not None]
        left.plot([r for r, _ in points], [v for _, v in points], marker="o", color=f"C{i}", label=f"{name} p99")
    left.set_yscale("log")
    plain_log_ticks(left.yaxis)
    left.set_xlabel("offered rate (req/s)")
    left.set_ylabel("p99 latency (ms)")
    right.plot(rates, [s["overall"]["throughput_rps"] for s in steps], marker="o", label="throughput")
    right.plot(rates, rates, linestyle=":", color="#999", label="offered")
    right.set_xlabel("offered rate (req/s)")
    right.set_ylabel("req/s")
    for ax in (left, right):
        if doc["knee_rps"] is not None:
            ax.axvline(doc["knee_rps"], color="C2", linestyle="--", label="knee")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    title = html.escape(f"Sweep: {doc['meta']['name']}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style></head>"
            f"<body><h1>{title}</h1><p><b>{html.escape(knee_line(doc))}</b></p>"
            f"<img alt='sweep' src='data:image/png;base64,{png_base64(fig)}'/>{sweep_table(doc).to_html()}</body></html>\n")


def _f(value) -> str:
    return "-" if value is None else f"{value:.1f}" if value >= 10 else f"{value:.2f}"
