"""The report's tables, built once from a report document and rendered as text, Markdown or HTML."""

from __future__ import annotations

import html
from dataclasses import dataclass

from loadtest.stats import STAGE_ORDER


@dataclass(frozen=True)
class Table:
    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    note: str = ""

    def to_text(self) -> str:
        widths = [max(len(h), *(len(r[i]) for r in self.rows)) if self.rows else len(h)
                  for i, h in enumerate(self.headers)]

        def line(cells) -> str:
            first = cells[0].ljust(widths[0])
            return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))]).rstrip()

        out = [self.title, line(self.headers), *(line(r) for r in self.rows)]
        if self.note:
            out.append(self.note)
        return "\n".join(out)

    def to_markdown(self) -> str:
        out = [f"### {self.title}", "", "| " + " | ".join(self.headers) + " |",
               "|" + "|".join(["---"] + ["---:"] * (len(self.headers) - 1)) + "|"]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in self.rows]
        if self.note:
            out += ["", f"_{self.note}_"]
        return "\n".join(out)

    def to_html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self.rows)
        note = f"<p class='note'>{html.escape(self.note)}</p>" if self.note else ""
        return f"<h3>{html.escape(self.title)}</h3><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"


def summary_lines(doc: dict) -> list[str]:
    """The heading: what ran, against what, and whether the generator kept up."""
    meta, gen = doc["meta"], doc["generator"]
    levels = meta["levels"]
    unit = meta["level_unit"]
    if len(levels) == 1 and levels[0]["from"] == levels[0]["to"]:
        shape = f"{levels[0]['from']:g} {unit}"
    else:
        shape = " → ".join(f"{s['from']:g}..{s['to']:g} {unit}/{s['duration_s']:g}s" for s in levels)
    mode = f"open loop, {meta['arrival']} arrivals" if meta["mode"] == "open" else "closed loop"
    if meta["arrival"] == "gamma" and meta["mode"] == "open":
        mode += f" (burstiness {meta['burstiness']:g})"
    lines = [
        f"infermesh load test · {meta['name']} → {meta['target']} · started {meta['started_at']}",
        f"{mode}, {shape}, {meta['duration_s']:g} s measured (+{meta['warmup_s']:g} s warm-up excluded)",
    ]
    lag = gen["lag_ms"]
    if meta["mode"] != "open":
        lines.append("generator: closed loop — latency excludes the waits the fixed concurrency hides "
                     "(coordinated omission); use open loop for tail latency")
    elif lag.get("count", 0) == 0:
        lines.append("generator: no measured sends")
    elif gen["fell_behind"]:
        lines.append(f"generator: FELL BEHIND its schedule — lag p99 {lag['p99']:.1f} ms, max {lag['max']:.1f} ms "
                     f"(> {gen['lag_warn_ms']:g} ms on {gen['num_late']} sends); results understate the load")
    else:
        lines.append(f"generator: on schedule (lag p99 {lag['p99']:.2f} ms, max {lag['max']:.2f} ms)")
    return lines


def _groups(doc: dict) -> list[tuple[str, dict]]:
    rows = [("overall", doc["overall"])]
    rows += [(f"class {n}", g) for n, g in doc["classes"].items()]
    rows += [(f"tenant {n}", g) for n, g in doc["tenants"].items()]
    if len(doc["priorities"]) > 1:
        rows += [(f"priority {n}", g) for n, g in doc["priorities"].items()]
    return rows


def latency_table(doc: dict) -> Table:
    rows = []
    for name, g in _groups(doc):
        lat = g["latency_ms"]
        tail = g["tail"]
        owner = f"{tail['top_stage']} ({tail['dominant_stage_counts'][tail['top_stage']]}/{tail['num_requests']})" \
            if tail else "-"
        rows.append((name, str(g["num_requests"]), str(g["num_ok"]), str(g["num_errors"]),
                     _f(g["throughput_rps"]), _f(g["goodput_rps"]), f"{g['goodput_ratio'] * 100:.1f}%",
                     *(_f(lat.get(k)) for k in ("p50", "p90", "p99")), _interval(g, "latency", "p99"),
                     *(_f(lat.get(k)) for k in ("p99.9", "max")),
                     _f(g["service_ms"].get("p99")), owner))
    return Table(
        "Latency (ms, from scheduled send time) and throughput (req/s)",
        ("group", "reqs", "ok", "err", "thr/s", "good/s", "good%", "p50", "p90", "p99", "p99 95% CI", "p99.9",
         "max", "svc p99", "tail owner (>p99)"),
        tuple(rows),
        "good = succeeded within its class SLO; svc = service time from the actual send; "
        "tail owner = stage that took the most time in most requests above p99; "
        "CI = bootstrap confidence interval of the percentile (report: ci_ms for every percentile)",
    )


def _interval(group: dict, metric: str, key: str) -> str:
    interval = (group.get("ci_ms") or {}).get(metric, {}).get(key)  # reports before ci_ms have none
    return f"{_f(interval[0])}–{_f(interval[1])}" if interval else "-"


def stream_table(doc: dict) -> Table | None:
    rows = []
    for name, g in _groups(doc):
        s = g["stream"]
        if not s or not name.startswith("class "):
            continue
        rows.append((name.removeprefix("class "), str(s["num_streams"]),
                     _f(s["ttft_ms"].get("p50")), _f(s["ttft_ms"].get("p99")),
                     _f(s["tpot_ms"].get("p50")), _f(s["tpot_ms"].get("p99")),
                     _f(s["itl_ms"].get("p50")), _f(s["itl_ms"].get("p99")),
                     _f(s["e2e_ms"].get("p50")), _f(s["e2e_ms"].get("p99")),
                     _f(s["mean_output_tokens"]), _f(s["output_tokens_per_s"])))
    if not rows:
        return None
    return Table("Streams (ms)", ("class", "streams", "ttft p50", "ttft p99", "tpot p50", "tpot p99", "itl p50",
                                  "itl p99", "e2e p50", "e2e p99", "tok/req", "tok/s"), tuple(rows),
                 "ttft from the scheduled send time; tpot = (last token − first token) / (tokens − 1); "
                 "itl = gap between token chunks")


def stage_table(doc: dict) -> Table | None:
    groups = [("overall", doc["overall"])] + [(f"class {n}", g) for n, g in doc["classes"].items()]
    stages = [s for s in _stage_union(g for _, g in groups)]
    if not stages:
        return None
    rows = []
    for name, g in groups:
        rows.append((name, *(_f(g["stages"].get(s, {}).get("mean_ms")) for s in stages)))
        tail = g["tail"]
        if tail:
            rows.append((f"  >p99 ({tail['num_requests']})", *(_f(tail["stage_mean_ms"].get(s)) for s in stages)))
    note = ("client_queue = waiting in the load generator; client_network = service time the servers "
            "did not account for; other = the rest")
    if doc["meta"].get("stages_reported") is False:
        note = (f"server stages: absent ({doc['meta'].get('target_kind', 'the target')} replies reported none); "
                "client_queue = waiting in the load generator; other = the whole service time")
    return Table("Per-stage mean (ms): all successful requests, then those above p99",
                 ("group", *stages), tuple(rows), note)


def error_table(doc: dict) -> Table | None:
    rows = []
    for name, g in _groups(doc):
        if name == "overall" or not name.startswith("class "):
            continue
        for code, count in g["errors"].items():
            rows.append((name.removeprefix("class "), code, str(count), g["error_examples"].get(code, "")[:80]))
    if not rows:
        return None
    return Table("Errors by status code", ("class", "status", "count", "example message"), tuple(rows))


def slowest_table(doc: dict) -> Table | None:
    slowest = doc.get("slowest") or []  # reports written before the key existed have none
    if not slowest:
        return None
    rows = tuple((str(r["seq"]), r["class"], r["tenant"], r["status"], _f(r["latency_ms"]), r["trace_id"] or "-")
                 for r in slowest)
    return Table("Slowest requests", ("seq", "class", "tenant", "status", "latency ms", "trace id"), rows,
                 "trace id: the W3C trace id sent in the request's traceparent; look it up in the tracing backend")


def server_metrics_table(doc: dict) -> Table | None:
    section = doc.get("server_metrics")
    if not section:
        return None
    rows = []
    for s in section["series"]:
        values = [p[1] for p in s["points"]]
        labels = ",".join(f"{k}={v}" for k, v in s["labels"].items())
        rows.append((s["name"] + (f"{{{labels}}}" if labels else ""), str(len(values)), _f(min(values)),
                     _f(sum(values) / len(values)), _f(max(values)), _f(values[-1])))
    failed = "; ".join(f"{e['url']}: {e['num_errors']}/{e['num_scrapes']} scrapes failed ({e['last_error']})"
                       for e in section["endpoints"] if e["num_errors"])
    return Table(f"Server metrics (scraped every {section['interval_s']:g} s)",
                 ("series", "points", "min", "mean", "max", "last"), tuple(rows), failed)


def window_table(doc: dict) -> Table:
    rows = tuple((_f(w["start_s"]), str(w["num_scheduled"]), str(w["num_ok"]), str(w["num_errors"]),
                  _f(w["throughput_rps"]), _f(w["p50_ms"]), _f(w["p99_ms"]), _f(w["max_ms"]))
                 for w in doc["windows"]["overall"])
    return Table(f"Over time ({doc['windows']['window_s']:g} s windows, from the end of warm-up)",
                 ("t (s)", "sched", "ok", "err", "thr/s", "p50", "p99", "max"), rows)


def report_tables(doc: dict, *, with_windows: bool) -> list[Table]:
    tables = [latency_table(doc), stream_table(doc), stage_table(doc), error_table(doc)]
    if with_windows:
        tables += [slowest_table(doc), server_metrics_table(doc), window_table(doc)]
    from loadtest.rollout_report import rollout_table  # it builds on Table

    tables.append(rollout_table(doc))
    return [t for t in tables if t is not None]


def _stage_union(groups) -> list[str]:
    seen: set[str] = set()
    for g in groups:
        seen.update(g["stages"])
    known = [s for s in STAGE_ORDER if s in seen]
    return known + sorted(seen - set(known))


def _f(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"
