"""The token fast path benchmark's tables: its JSON (bench_token_path) in, Markdown out. Pure."""

from __future__ import annotations

import math

from bench.harness.tables import markdown_table


def _runs_text(values: list[float]) -> str:
    return ", ".join("-" if v is None or math.isnan(v) else f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}"
                     for v in values)


def targets_table(doc: dict) -> str:
    rows = [(key, f["target"], f["median"], _runs_text(f["runs"]), f["met"]) for key, f in doc["headline"].items()]
    return markdown_table(["figure", "target", "median", "every run", "met?"], rows)


def scheduler_table(doc: dict) -> str:
    rows = []
    for run in doc["runs"]:
        s = run.get("scheduler")
        if s:
            rows.append((run["run"], _load(s), s["tokens_per_s"], s["cpu_us_per_token"]["scheduler"],
                         s["cpu_cores"]["scheduler"], s["cpu_cores"]["client"], s["cpu_us_per_token"]["client"],
                         s["cpu_cores"]["workers"], s["num_completed"], s["num_short"], s["num_errors"]))
    return markdown_table(["run", "load avg 1m", "tokens/s", "sched us/token", "sched cores", "client cores",
                           "client us/token", "workers cores", "streams done", "short", "errors"], rows)


def gateway_table(doc: dict) -> str:
    rows = []
    for run in doc["runs"]:
        g = run.get("gateway")
        if not g:
            continue
        for mode in ("stream", "coalesced", "unary"):
            m = g.get(mode)
            if m:
                rows.append((run["run"], mode, _load(g), m["tokens_per_s"], m["cpu_us_per_token"]["gateway"],
                             m["cpu_cores"]["gateway"], m["cpu_us_per_token"]["scheduler"], m["cpu_cores"]["client"],
                             m["num_completed"], m["num_short"], m["num_errors"]))
    return markdown_table(["run", "mode", "load avg 1m", "tokens/s", "gateway us/token", "gateway cores",
                           "sched us/token", "client cores", "streams done", "short", "errors"], rows)


def e2e_table(doc: dict) -> str:
    rows = []
    for run in doc["runs"]:
        e = run.get("e2e")
        if not e:
            continue
        for variant, ratios in e["over_baseline"].items():
            for mesh, base in zip(e[variant], e["baseline"], strict=True):
                r = ratios[mesh["phase"]]
                rows.append((run["run"], variant, mesh["phase"], f"{_load(mesh)} / {_load(base)}",
                             f"{mesh['e2e_p50_ms']:.0f} / {mesh['e2e_p99_ms']:.0f}",
                             f"{base['e2e_p50_ms']:.0f} / {base['e2e_p99_ms']:.0f}",
                             f"{mesh['ttft_p50_ms']:.0f} / {base['ttft_p50_ms']:.0f}",
                             f"{mesh['tokens_per_s']:.0f} / {base['tokens_per_s']:.0f}",
                             f"{r['e2e_p50']} / {r['e2e_p99']} / {r['tokens_per_s']}",
                             f"{mesh['num_ok']}/{mesh['num_requests']} {_errors(mesh)}",
                             f"{base['num_ok']}/{base['num_requests']}", f"{_lag(mesh)} / {_lag(base)}"))
    return markdown_table(["run", "mesh", "load", "load avg mesh / base", "mesh p50 / p99 ms",
                           "baseline p50 / p99 ms", "ttft p50 mesh / base", "tokens/s mesh / base",
                           "ratio p50 / p99 / tok/s", "mesh ok", "base ok", "generator lag p99 ms mesh / base"], rows)


def profile_table(profile: dict, key: str) -> str:
    rows = [(f["name"], f"{100 * f['self_share']:.1f}%", f"{100 * f['total_share']:.1f}%") for f in profile[key]]
    return markdown_table(["function (file)", "self", "total"], rows)


def owner_table(profile: dict) -> str:
    rows = [(f["name"], f"{100 * f['share']:.1f}%") for f in profile["by_owner"]]
    return markdown_table(["innermost services/ function (with what it calls)", "share"], rows)


def _load(section: dict) -> str:
    return f"{section['load_average'][0]:.1f}"


def _lag(figures: dict) -> str:
    """The load generator's p99 lag; "-" in runs recorded before it was measured."""
    lag = figures.get("lag_p99_ms")
    return "-" if lag is None else f"{lag:.1f}"


def _errors(figures: dict) -> str:
    return " ".join(f"{code} {n}" for code, n in figures["errors"].items())


def print_tables(doc: dict) -> None:
    print("\n" + targets_table(doc))
    if any("scheduler" in r for r in doc["runs"]):
        print("\nscheduler, 4 mock workers x 64 sequences, 2 ms steps, Submit stream from this process\n"
              + scheduler_table(doc))
    if any("gateway" in r for r in doc["runs"]):
        print("\ngateway, 64 streams of 256 tokens\n" + gateway_table(doc))
    if any("e2e" in r for r in doc["runs"]):
        print("\ne2e on tinylm, mesh vs in-process request-level batching\n" + e2e_table(doc))
    for run in doc["runs"]:
        for part, section in (("scheduler", run.get("scheduler")), ("gateway", (run.get("gateway") or {}).get("stream"))):
            for kind, profile in ((section or {}).get("profile") or {}).items():
                if "by_self" in profile:
                    print(f"\n{part} profile, {kind} frames ({profile['num_samples']} samples), top by self\n"
                          + profile_table(profile, "by_self"))
                    print(f"\n{part} profile, {kind} frames, top by total\n" + profile_table(profile, "by_total"))
                    if "by_owner" in profile:
                        print(f"\n{part} profile, {kind} frames, by innermost services/ frame\n" + owner_table(profile))
