"""A/B in one run: two targets share one open-loop schedule in alternating time slices.

Slice k (of `slice_s` seconds from the run's start) goes to target A when k is even and to B
when odd, so whatever else the machine does during the run falls on both alike. The schedule
is stretched to twice the scenario's duration, so each target gets the scenario's measured
time at the scenario's rates. Each target's records become an ordinary report; the A/B
document sets them side by side, with B/A ratios and each percentile's confidence interval
(`compare`'s "no change" when they overlap, else the effect).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loadtest.compare import Comparison, compare_reports
from loadtest.records import Outcome, RequestRecord
from loadtest.tables import Table
from loadtest.targets.base import Target
from loadtest.workload import PlannedRequest

AB_SCHEMA = "infermesh.loadtest.ab/v1"
SIDES = ("a", "b")
AB_METRICS = ("p50", "p90", "p99", "p99.9", "throughput", "goodput_ratio", "error_ratio", "ttft_p50", "ttft_p99",
              "tpot_p50", "tpot_p99", "itl_p99")


def slice_owner(scheduled_s: float, slice_s: float) -> int:
    """0 (A) or 1 (B): who serves a request due at `scheduled_s`."""
    return math.floor(scheduled_s / slice_s) % 2


def owned_time_s(start_s: float, end_s: float, slice_s: float, owner: int) -> float:
    """How much of [start_s, end_s) lies in `owner`'s slices."""
    total = 0.0
    k = math.floor(start_s / slice_s)
    while k * slice_s < end_s:
        if k % 2 == owner:
            total += max(0.0, min(end_s, (k + 1) * slice_s) - max(start_s, k * slice_s))
        k += 1
    return total


class SlicedTarget:
    """A Target that hands each request to A or B by its slice; the runner sees one target."""

    def __init__(self, a: Target, b: Target, slice_s: float) -> None:
        if not slice_s > 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s}")
        self._targets = (a, b)
        self._slice_s = slice_s

    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome:
        return await self._targets[slice_owner(request.scheduled_s, self._slice_s)].send(request, timeout_s)

    async def ready_models(self, models, api_key: str, timeout_s: float) -> set[str]:
        ready_a = await self._targets[0].ready_models(models, api_key, timeout_s)
        return ready_a & await self._targets[1].ready_models(models, api_key, timeout_s)

    async def close(self) -> None:
        for target in self._targets:
            await target.close()


def split_records(records: Sequence[RequestRecord], slice_s: float) -> tuple[tuple[RequestRecord, ...], ...]:
    return tuple(tuple(r for r in records if slice_owner(r.scheduled_s, slice_s) == side) for side in (0, 1))


def side_by_side(doc_a: dict, doc_b: dict) -> list[Comparison]:
    """Every shared group's headline metrics, B against A."""
    cells, _ = compare_reports(doc_a, doc_b, [], metrics=AB_METRICS)
    return cells


def ab_document(doc_a: dict, doc_b: dict, slice_s: float) -> dict:
    cells = side_by_side(doc_a, doc_b)
    return {
        "schema": AB_SCHEMA,
        "meta": {"name": doc_a["meta"]["name"], "started_at": doc_a["meta"]["started_at"], "slice_s": slice_s,
                 "target_a": doc_a["meta"]["target"], "target_b": doc_b["meta"]["target"]},
        "a": doc_a,
        "b": doc_b,
        "comparison": [{"group": c.group, "metric": c.metric, "a": c.base, "b": c.new,
                        "ratio": _ratio(c), "a_ci": c.base_ci, "b_ci": c.new_ci, "effect": c.effect}
                       for c in cells],
    }


def ab_table(doc: dict) -> Table:
    rows = tuple((c["group"], c["metric"], _fmt(c["a"]), _ci(c["a_ci"]), _fmt(c["b"]), _ci(c["b_ci"]),
                  "-" if c["ratio"] is None else f"{c['ratio']:.3f}", c["effect"]) for c in doc["comparison"])
    meta = doc["meta"]
    return Table(f"A/B: A = {meta['target_a']}, B = {meta['target_b']} ({meta['slice_s']:g} s slices, alternating)",
                 ("group", "metric", "A", "A 95% CI", "B", "B 95% CI", "B/A", "effect"), rows,
                 "latency metrics in ms, throughput in req/s; effect: 'no change' when the intervals overlap, "
                 "else B's shift from A")


def _ratio(c: Comparison) -> float | None:
    if c.base is None or c.new is None or c.base == 0:
        return None
    return round(c.new / c.base, 4)


def _ci(interval) -> str:
    return "-" if not interval else f"[{_fmt(interval[0])}, {_fmt(interval[1])}]"


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.0f}"


def ab_markdown(doc: dict) -> str:
    from loadtest.tables import latency_table, summary_lines

    parts = [f"# A/B: {doc['meta']['name']}", "", ab_table(doc).to_markdown(), ""]
    for side in SIDES:
        report = doc[side]
        parts += [f"## {side.upper()}: {report['meta']['target']}", "",
                  *(f"- {line}" for line in summary_lines(report)[1:]), "", latency_table(report).to_markdown(), ""]
    return "\n".join(parts)


def ab_html(doc: dict) -> str:
    import html

    from loadtest.report_html import STYLE
    from loadtest.tables import latency_table

    title = html.escape(f"A/B: {doc['meta']['name']}")
    sides = "".join(f"<h2>{side.upper()}: {html.escape(doc[side]['meta']['target'])}</h2>"
                    + latency_table(doc[side]).to_html() for side in SIDES)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style>"
            f"</head><body><h1>{title}</h1>{ab_table(doc).to_html()}{sides}"
            f"<p class='note'>schema {html.escape(doc['schema'])}</p></body></html>\n")
