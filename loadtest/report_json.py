"""The versioned JSON report: build it from a run, check it, read it back.

Schema "infermesh.loadtest/v1". Keys are only ever added within v1; a change
that renames or removes a key bumps the version, and `compare` refuses to mix
versions. docs/loadtest.md lists every key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from loadtest import REPORT_SCHEMA
from loadtest.records import RequestRecord
from loadtest.runner import RunResult
from loadtest.scenario import Scenario, Slo
from loadtest.stats import generator_lag, summarize_group, time_windows
from loadtest.targets.address import parse_target

# The report's JSON Schema (draft 2020-12); one file per schema version, checked in tests.
SCHEMA_PATH = Path(__file__).parent / "schema" / "report-v1.schema.json"

REQUIRED_TOP_KEYS = ("schema", "meta", "generator", "overall", "classes", "tenants", "priorities", "windows")
REQUIRED_GROUP_KEYS = ("num_requests", "num_ok", "num_errors", "errors", "offered_rps", "throughput_rps",
                       "goodput_rps", "goodput_ratio", "error_ratio", "latency_ms", "service_ms", "cdf_ms",
                       "stream", "stages", "tail")


def build_report(scenario: Scenario, result: RunResult, *, target: str, started_at: str) -> dict:
    measured = [r for r in result.records if r.measured]
    slo_by_class = {c.name: c.slo for c in scenario.classes}

    def slo_of(r: RequestRecord) -> Slo:
        return slo_by_class.get(r.class_name, Slo())

    def group(records: Sequence[RequestRecord], slo: Slo | None = None) -> dict:
        return summarize_group(records, result.measured_s, slo_of, slo)

    window_s = scenario.window_s or _auto_window_s(result.measured_s)
    return {
        "schema": REPORT_SCHEMA,
        "meta": _meta(scenario, target, started_at, window_s, len(result.records) - len(measured))
        | {"stages_reported": any(r.stages or r.server_total_us for r in measured)},
        "generator": generator_lag(result.lag_us, scenario.lag_warn_ms) | {
            "mode": scenario.load.mode.value,
        },
        "overall": group(measured),
        "classes": {c.name: group([r for r in measured if r.class_name == c.name], c.slo) for c in scenario.classes},
        "tenants": {t.name: group([r for r in measured if r.tenant == t.name]) for t in scenario.tenants},
        "priorities": {p: group([r for r in measured if r.priority == p])
                       for p in sorted({t.priority for t in scenario.tenants})},
        "slowest": slowest_requests(measured),
        "windows": side_windows(scenario, measured, result.measured_s, window_s),
    }


def side_windows(scenario: Scenario, measured: Sequence[RequestRecord], measured_s: float, window_s: float) -> dict:
    """The over-time windows of `measured_s` from the end of warm-up (for an A/B side: the whole run's)."""
    return {
        "window_s": window_s,
        "overall": time_windows(measured, scenario.warmup_s, measured_s, window_s),
        "classes": {c.name: time_windows([r for r in measured if r.class_name == c.name], scenario.warmup_s,
                                         measured_s, window_s) for c in scenario.classes},
    }


NUM_SLOWEST = 10


def slowest_requests(records: Sequence[RequestRecord], num: int = NUM_SLOWEST) -> list[dict]:
    """The slowest measured requests, failed ones included, with the trace id each was sent with,
    so an operator can open them in a tracing backend."""
    ranked = sorted(records, key=lambda r: r.latency_s, reverse=True)[:num]
    return [{"seq": r.seq, "class": r.class_name, "tenant": r.tenant, "status": r.status,
             "latency_ms": round(r.latency_s * 1000, 3), "trace_id": r.trace_id} for r in ranked]


def validate_report(doc: dict) -> None:
    """Raises ValueError naming the first thing that is not a v1 report."""
    if not isinstance(doc, dict):
        raise ValueError(f"report: expected a JSON object, got {type(doc).__name__}")
    if doc.get("schema") != REPORT_SCHEMA:
        raise ValueError(f"report: schema is {doc.get('schema')!r}, expected {REPORT_SCHEMA!r}")
    missing = [k for k in REQUIRED_TOP_KEYS if k not in doc]
    if missing:
        raise ValueError(f"report: missing top-level key(s) {missing}")
    for name, group in _groups(doc):
        absent = [k for k in REQUIRED_GROUP_KEYS if k not in group]
        if absent:
            raise ValueError(f"report: group {name!r} lacks key(s) {absent}")


def write_json(doc: dict, path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def load_report(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    validate_report(doc)
    return doc


def groups_of(doc: dict) -> dict[str, dict]:
    """Every group under a stable name: "overall", "class:NAME", "tenant:NAME", "priority:NAME"."""
    return dict(_groups(doc))


def _groups(doc: dict):
    yield "overall", doc["overall"]
    for section, prefix in (("classes", "class"), ("tenants", "tenant"), ("priorities", "priority")):
        for name, group in doc[section].items():
            yield f"{prefix}:{name}", group


def _meta(scenario: Scenario, target: str, started_at: str, window_s: float, num_warmup: int) -> dict:
    load = scenario.load
    return {
        "name": scenario.name,
        "target": target,
        "target_kind": _target_kind(target),
        "started_at": started_at,
        "mode": load.mode.value,
        "arrival": load.arrival.value,
        "burstiness": load.burstiness,
        "levels": [{"duration_s": s.duration_s, "from": s.from_value, "to": s.to_value} for s in load.levels],
        "level_unit": "rps" if load.mode.value == "open" else "clients",
        "max_in_flight": load.max_in_flight,
        "think_time_ms": load.think_time_ms,
        "duration_s": scenario.duration_s,
        "warmup_s": scenario.warmup_s,
        "num_warmup_requests": num_warmup,
        "seed": scenario.seed,
        "window_s": window_s,
        "trace": None if scenario.trace is None else {
            "path": str(scenario.trace.path), "speedup": scenario.trace.speedup, "class": scenario.trace.class_name,
            "num_requests": len(scenario.trace.entries)},
        # API keys stay out of reports: they are shared and archived.
        "tenants": [{"name": t.name, "share": round(t.share, 4), "priority": t.priority} for t in scenario.tenants],
        "classes": [
            {"name": c.name, "kind": c.kind.value, "model": c.model, "version": c.version,
             "share": round(c.share, 4), "deadline_ms": c.deadline_ms, "slo": c.slo.as_dict()}
            for c in scenario.classes
        ],
    }


def _target_kind(target: str) -> str:
    try:
        return parse_target(target).kind.value
    except ValueError:  # a report built for a test or from a caller's own label
        return "unknown"


def _auto_window_s(measured_s: float) -> float:
    """One-second windows, widened so a long run has at most 120 of them."""
    return max(1.0, round(measured_s / 120, 1))
