"""A self-contained HTML report: the tables plus matplotlib plots embedded as base64 PNG.

Drawn only from the report document, so any saved JSON report can be
re-rendered. Uses matplotlib's object API (Figure, no pyplot): no global state,
no display needed.
"""

from __future__ import annotations

import base64
import html
import io
import math

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from loadtest.stats import STAGE_ORDER
from loadtest.tables import report_tables, summary_lines

STYLE = """
body{font-family:system-ui,-apple-system,sans-serif;margin:2em auto;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em;font-size:13px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3}
.note{color:#666;font-size:12px;margin-top:-1em}
img{max-width:100%;border:1px solid #eee;margin:.5em 0}
.warn{color:#b00;font-weight:bold}
"""


def html_report(doc: dict) -> str:
    lines = summary_lines(doc)
    heading = "".join(
        f"<p class='warn'>{html.escape(line)}</p>" if "FELL BEHIND" in line else f"<p>{html.escape(line)}</p>"
        for line in lines[1:])
    plots = [
        ("Latency over time (p50 and p99 per window, by class)", _latency_over_time(doc)),
        ("Throughput over time", _throughput_over_time(doc)),
        ("Latency distribution: CDF (left) and the tail on a nines scale (right)", _cdf(doc)),
        ("Where the time goes: mean per stage, all requests vs the tail (> p99)", _stage_bars(doc)),
        ("Server metrics (scraped) beside latency", _server_metrics(doc)),
    ]
    images = "".join(f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
                     f"src='data:image/png;base64,{png}'/>" for title, png in plots if png)
    tables = "".join(t.to_html() for t in report_tables(doc, with_windows=True))
    title = html.escape(f"Load test: {doc['meta']['name']}")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style>"
            f"</head><body><h1>{title}</h1><p>{html.escape(lines[0])}</p>{heading}{images}"
            f"<h2>Tables</h2>{tables}<p class='note'>schema {html.escape(doc['schema'])}</p></body></html>\n")


def png_base64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _latency_over_time(doc: dict) -> str | None:
    series = doc["windows"]["classes"]
    if not any(w["p50_ms"] is not None for ws in series.values() for w in ws):
        return None
    fig = Figure(figsize=(10, 4))
    ax = fig.subplots()
    for i, (name, windows) in enumerate(series.items()):
        color = f"C{i % 10}"
        xs = [w["start_s"] for w in windows]
        ax.plot(xs, [w["p99_ms"] for w in windows], color=color, label=f"{name} p99")
        ax.plot(xs, [w["p50_ms"] for w in windows], color=color, linestyle="--", label=f"{name} p50")
    ax.set_yscale("log")
    plain_log_ticks(ax.yaxis)
    ax.set_xlabel("seconds since warm-up ended (by scheduled send time)")
    ax.set_ylabel("latency (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return png_base64(fig)


def _server_metrics(doc: dict) -> str | None:
    """p99 per window on top; each scraped series below it, on the same time axis."""
    series = [s for s in (doc.get("server_metrics") or {}).get("series", []) if s["points"]]
    if not series:
        return None
    fig = Figure(figsize=(10, 2.2 * (1 + len(series))))
    axes = fig.subplots(1 + len(series), 1, sharex=True, squeeze=False)[:, 0]
    windows = doc["windows"]["overall"]
    axes[0].plot([w["start_s"] for w in windows], [w["p99_ms"] for w in windows], color="C3", label="p99 (ms)")
    axes[0].set_ylabel("latency p99 (ms)")
    axes[0].grid(True, alpha=0.3)
    for i, s in enumerate(series, 1):
        labels = ",".join(f"{k}={v}" for k, v in s["labels"].items())
        axes[i].plot([p[0] for p in s["points"]], [p[1] for p in s["points"]], color=f"C{i % 10}")
        axes[i].set_title(f"{s['name']}{{{labels}}}", fontsize=8, loc="left")
        axes[i].grid(True, alpha=0.3)
    axes[-1].set_xlabel("seconds since warm-up ended")
    return png_base64(fig)


def _throughput_over_time(doc: dict) -> str | None:
    windows = doc["windows"]["overall"]
    if not windows:
        return None
    fig = Figure(figsize=(10, 3))
    ax = fig.subplots()
    width = doc["windows"]["window_s"]
    xs = [w["start_s"] for w in windows]
    ax.bar(xs, [w["throughput_rps"] for w in windows], width=width * 0.9, align="edge", color="C0", label="ok/s")
    ax.bar(xs, [w["num_errors"] / width for w in windows], width=width * 0.9, align="edge",
           bottom=[w["throughput_rps"] for w in windows], color="C3", label="errors/s")
    ax.plot([x + width / 2 for x in xs], [w["num_scheduled"] / width for w in windows], color="k", marker=".",
            linewidth=1, label="scheduled/s")
    ax.set_xlabel("seconds since warm-up ended")
    ax.set_ylabel("requests/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return png_base64(fig)


def _cdf(doc: dict) -> str | None:
    groups = [("overall", doc["overall"])] + list(doc["classes"].items())
    groups = [(n, g) for n, g in groups if g["cdf_ms"]]
    if not groups:
        return None
    fig = Figure(figsize=(11, 4))
    body, tail = fig.subplots(1, 2)
    for i, (name, g) in enumerate(groups):
        style = dict(marker=".", color=f"C{i % 10}", label=name, linewidth=2 if name == "overall" else 1)
        points = [(p, max(ms, 1e-3)) for p, ms in g["cdf_ms"]]
        body.plot([ms for _, ms in points], [p for p, _ in points], **style)
        # Nines scale: x = -log10(1 - p), so 90, 99, 99.9 are evenly spaced; p = 100 has no place on it.
        nines = [(_nines(p), ms) for p, ms in points if p < 100]
        tail.plot([x for x, _ in nines], [ms for _, ms in nines], **style)
    for p in (50, 90, 99):
        body.axhline(p, color="#999", linewidth=0.5, linestyle=":")
    body.set_xscale("log")
    plain_log_ticks(body.xaxis)
    body.set_xlabel("latency (ms)")
    body.set_ylabel("percentile")
    ticks = [0, 90, 99, 99.9, 99.99]
    tail.set_xticks([_nines(p) for p in ticks], [f"{p:g}" for p in ticks])
    tail.set_yscale("log")
    plain_log_ticks(tail.yaxis)
    tail.set_xlabel("percentile")
    tail.set_ylabel("latency (ms)")
    for ax in (body, tail):
        ax.grid(True, which="both", alpha=0.3)
    body.legend(fontsize=8)
    return png_base64(fig)


def _nines(percentile: float) -> float:
    return -math.log10(1 - percentile / 100)


def plain_log_ticks(axis) -> None:
    """1, 2, 5, 10, 20, 50 rather than 10^0, 10^1 on log axes, so a range inside one decade is labelled."""
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(
        lambda v, _: f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v)), 6) in (2, 5) else ""))


def _stage_bars(doc: dict) -> str | None:
    bars: list[tuple[str, dict[str, float]]] = []
    for name, g in [("overall", doc["overall"])] + list(doc["classes"].items()):
        if not g["stages"]:
            continue
        bars.append((f"{name}\nall", {s: v["mean_ms"] for s, v in g["stages"].items()}))
        if g["tail"]:
            bars.append((f"{name}\n>p99", g["tail"]["stage_mean_ms"]))
    if not bars:
        return None
    seen = {s for _, stages in bars for s in stages}
    stages = [s for s in STAGE_ORDER if s in seen] + sorted(seen - set(STAGE_ORDER))
    fig = Figure(figsize=(max(6.0, 1.2 * len(bars) + 3), 4.5))
    ax = fig.subplots()
    bottoms = [0.0] * len(bars)
    for i, stage in enumerate(stages):
        heights = [stage_ms.get(stage, 0.0) for _, stage_ms in bars]
        ax.bar(range(len(bars)), heights, bottom=bottoms, label=stage, color=f"C{i % 10}",
               hatch="//" if i >= 10 else None)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.set_ylabel("mean ms per request")
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    return png_base64(fig)
