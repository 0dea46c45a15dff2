"""python -m loadtest {run,compare,sweep,ab,render}: the command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_REGRESSION = 1  # compare: a metric regressed beyond its threshold
EXIT_USAGE = 2  # bad arguments, scenario or report
EXIT_NOT_READY = 3  # run/sweep: the target did not answer or serve the models
EXIT_NO_SUCCESS = 4  # run: not one request succeeded


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as err:
        print(f"loadtest: {err}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    # Every option says its default: a literal one, or which scenario field it overrides.
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                     epilog="Scenario format: docs/loadtest.md. Tenants' API keys may come from "
                                            "an environment variable (api_key_env) or a file (api_key_file).")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a scenario and write JSON, Markdown and HTML reports",
                         description="Run a scenario against a target (infermesh, OpenAI or KServe) and write its reports.")
    run.add_argument("scenario", type=Path, help="scenario YAML (e.g. loadtest/scenarios/demo.yaml)")
    _add_target_args(run)
    run.add_argument("--duration-s", type=float,
                     help="measured time; scales staged schedules (default: the scenario's duration_s)")
    run.add_argument("--warmup-s", type=float,
                     help="warm-up, sent but excluded from results (default: the scenario's warmup_s, else 0)")
    run.add_argument("--rate-rps", type=float,
                     help="replace the schedule by this constant rate, open loop (default: the scenario's load)")
    run.add_argument("--scrape", nargs="+", default=[], metavar="URL",
                     help="Prometheus endpoints to scrape during the run (ours or a peer's /metrics; https ones are "
                          "verified with --ca-file); the report plots the chosen series beside latency (default: none)")
    run.add_argument("--scrape-series", nargs="+", metavar="PATTERN",
                     help="fnmatch patterns of the sample names to keep (default: queue, waiting, running, KV-cache "
                          "usage and in-flight gauges of infermesh and vLLM: loadtest/scrape.py DEFAULT_SERIES)")
    run.add_argument("--scrape-interval-s", type=float, default=1.0, help="seconds between scrapes (default: %(default)s)")
    run.add_argument("--trace", type=Path,
                     help="replay this JSONL trace (Mooncake/AIPerf or infermesh layout; docs/loadtest.md) instead "
                          "of the load's arrivals (default: the scenario's trace section, else none)")
    run.add_argument("--speedup", type=float,
                     help="replay the trace this many times faster (default: trace.speedup, else 1)")
    run.add_argument("--seed", type=int, help="seed of arrivals and payloads (default: the scenario's seed, else 1)")
    run.add_argument("--name", help="report name (default: the scenario's name, else its file name)")
    run.add_argument("--out", type=Path, default=Path("reports"), help="report directory (default: %(default)s)")
    run.add_argument("--formats", default="json,md,html", help="comma-separated: json,md,html (default: %(default)s)")
    run.add_argument("--rollout-state-file", type=Path,
                     help="the gateway's --rollout-state-file: add the rollout decisions made during the run to the "
                          "report, on the windows' timeline (loadtest/rollout_report.py; default: none)")
    run.set_defaults(handler=_cmd_run)

    compare = sub.add_parser("compare", help="compare two JSON reports; exit 1 on a regression",
                             description="Compare two JSON reports group by group; exit 1 on a regression.")
    compare.add_argument("base", type=Path, help="the baseline report (JSON)")
    compare.add_argument("new", type=Path, help="the report to judge (JSON)")
    compare.add_argument("--max-regression", action="append", default=[], metavar="METRIC=LIMIT",
                         help="e.g. p99=10%%, p99.9=25ms, throughput=5%%, error_ratio=1%% (repeatable, or "
                              "comma-separated; default: none, the table is printed and nothing gates)")
    compare.add_argument("--groups", help="comma-separated groups to compare: overall, class:NAME, tenant:NAME "
                                          "(default: all in the base report)")
    compare.add_argument("--min-requests", type=int, default=1,
                         help="groups with fewer requests are not gated (default: %(default)s)")
    compare.set_defaults(handler=_cmd_compare)

    sweep = sub.add_parser("sweep", help="raise the rate until an SLO breaks; report the knee",
                           description="Raise the open-loop rate step by step until an SLO breaks, then bisect. "
                                       "Each option overrides the scenario's `sweep` section.")
    sweep.add_argument("scenario", type=Path, help="scenario YAML")
    _add_target_args(sweep)
    sweep.add_argument("--start-rps", type=float, help="first rate (default: sweep.start_rps, else the load's rate)")
    sweep.add_argument("--step-rps", type=float, help="added each step (default: sweep.step_rps, else start)")
    sweep.add_argument("--factor", type=float,
                       help="multiply the rate by this each step instead of adding (default: sweep.factor, unset)")
    sweep.add_argument("--max-rps", type=float, help="stop here (default: sweep.max_rps, else 20 x start)")
    sweep.add_argument("--step-duration-s", type=float, help="measured time per step (default: sweep.step_duration_s, else 10)")
    sweep.add_argument("--min-goodput-ratio", type=float,
                       help="every class must keep this share within its SLO (default: sweep.min_goodput_ratio, else 0.99)")
    sweep.add_argument("--max-error-ratio", type=float,
                       help="largest error share a passing step may have (default: sweep.max_error_ratio, else 0.01)")
    sweep.add_argument("--refine-steps", type=int,
                       help="bisections between the last passing and first failing rate (default: sweep.refine_steps, else 2)")
    sweep.add_argument("--out", type=Path, default=Path("reports"), help="report directory (default: %(default)s)")
    sweep.set_defaults(handler=_cmd_sweep)

    ab = sub.add_parser("ab", help="A/B: two targets on one schedule in alternating time slices, side by side",
                        description="Interleave two targets' schedules in time slices (so noise on a shared machine "
                                    "falls on both) and report them side by side with B/A ratios and intervals.")
    ab.add_argument("scenario", type=Path, help="scenario YAML (open loop)")
    ab.add_argument("--target", action="append", default=[], required=True,
                    help="give twice: A, then B (URLs as for run; no default: both are required)")
    ab.add_argument("--slice-s", type=float, default=1.0, help="length of each time slice (default: %(default)s)")
    ab.add_argument("--duration-s", type=float,
                    help="measured time per target; the run lasts twice this (default: the scenario's duration_s)")
    ab.add_argument("--wait-ready-s", type=float, default=10.0,
                    help="wait this long for both targets to serve the models; 0 skips (default: %(default)s)")
    ab.add_argument("--no-progress", action="store_true", help="no live progress line (default: shown)")
    ab.add_argument("--ca-file", default="", help="PEM CA bundle for both targets (as for run; default: none)")
    ab.add_argument("--out", type=Path, default=Path("reports"), help="report directory (default: %(default)s)")
    ab.set_defaults(handler=_cmd_ab)

    render = sub.add_parser("render", help="re-render Markdown/HTML (and the summary) from a JSON report",
                            description="Re-render Markdown and HTML from a JSON report.")
    render.add_argument("report", type=Path, help="a JSON report written by run or sweep")
    render.add_argument("--out", type=Path, help="directory (default: next to the report)")
    render.set_defaults(handler=_cmd_render)
    return parser


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HOST:PORT or grpc://, openai+http(s)://HOST:PORT/v1, kserve+grpc://, "
                                    "kserve+http(s):// (docs/loadtest.md, Targets; default: the scenario's "
                                    "target, else 127.0.0.1:50051)")
    p.add_argument("--wait-ready-s", type=float, default=10.0,
                   help="wait this long for the target to serve the scenario's models; 0 skips the check "
                        "(default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no live progress line (default: shown)")
    p.add_argument("--ca-file", default="", help="PEM CA bundle: gRPC targets talk TLS and verify against it; "
                   "https targets verify against it (make demo: run/tls/ca.pem); default: gRPC plaintext, "
                   "https with the system's roots")


def _load(path: Path):
    import yaml

    from loadtest.scenario import load_scenario

    try:
        return load_scenario(path)
    except OSError as err:
        raise ValueError(f"cannot read scenario: {err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML: {err}") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _cmd_run(args: argparse.Namespace) -> int:
    from loadtest.execute import RunOptions, TargetNotReady, report_stem, run_blocking, write_reports
    from loadtest.report_text import terminal_summary
    from loadtest.scenario import LoadMode
    from loadtest.scrape import DEFAULT_SERIES

    scenario = _load(args.scenario)
    if args.warmup_s is not None:
        scenario = dataclasses.replace(scenario, warmup_s=args.warmup_s)
    if args.trace is not None or args.speedup is not None or (scenario.trace and args.warmup_s is not None):
        scenario = _with_trace(scenario, args.trace, args.speedup)  # the replay's length follows the warm-up
    if scenario.trace is not None and (args.rate_rps is not None or args.duration_s is not None):
        raise ValueError("--rate-rps and --duration-s do not apply to a trace replay (use --speedup)")
    if args.rate_rps is not None:
        if scenario.load.mode is not LoadMode.OPEN:
            raise ValueError("--rate-rps applies to open-loop scenarios; this one is closed-loop")
        scenario = scenario.with_constant_level(args.rate_rps)
    if args.duration_s is not None:
        scenario = scenario.with_duration(args.duration_s)
    for field in ("warmup_s", "seed", "name"):
        if getattr(args, field) is not None:
            scenario = dataclasses.replace(scenario, **{field: getattr(args, field)})
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    unknown = set(formats) - {"json", "md", "html"}
    if unknown:
        raise ValueError(f"--formats: unknown format(s) {sorted(unknown)}; use json, md, html")
    target = args.target or scenario.target
    try:
        doc = run_blocking(scenario, RunOptions(
            target, not args.no_progress, args.wait_ready_s, ca_file=args.ca_file, scrape_urls=tuple(args.scrape),
            scrape_series=tuple(args.scrape_series or DEFAULT_SERIES), scrape_interval_s=args.scrape_interval_s))
    except TargetNotReady as err:
        print(f"loadtest: target {target} not ready: {err}", file=sys.stderr)
        return EXIT_NOT_READY
    if args.rollout_state_file is not None:
        from loadtest.rollout_report import rollout_section

        doc["rollout"] = rollout_section(doc, args.rollout_state_file)
    print(terminal_summary(doc))
    paths = write_reports(doc, args.out, report_stem(doc), formats)
    for kind, path in paths.items():
        print(f"{kind:>4} report: {path}")
    if doc["overall"]["num_requests"] and not doc["overall"]["num_ok"]:
        print("loadtest: no request succeeded", file=sys.stderr)
        return EXIT_NO_SUCCESS
    return EXIT_OK


def _with_trace(scenario, trace: Path | None, speedup: float | None):
    if trace is None and scenario.trace is None:
        raise ValueError("--speedup applies to a trace replay: give --trace or a scenario with a trace section")
    spec = scenario.trace
    return scenario.with_trace(trace or spec.path, speedup or (spec.speedup if spec else 1.0),
                               spec.class_name if spec else "", spec.block_tokens if spec else 512)


def _cmd_compare(args: argparse.Namespace) -> int:
    from loadtest.compare import compare_reports, comparison_table, parse_threshold
    from loadtest.report_json import load_report

    base, new = load_report(args.base), load_report(args.new)
    specs = [s for arg in args.max_regression for s in arg.split(",") if s.strip()]
    thresholds = [parse_threshold(s) for s in specs]
    groups = [g.strip() for g in args.groups.split(",")] if args.groups else None
    cells, warnings = compare_reports(base, new, thresholds, groups, args.min_requests)
    print(f"base: {args.base} ({base['meta']['name']}, {base['meta']['started_at']})")
    print(f"new:  {args.new} ({new['meta']['name']}, {new['meta']['started_at']})\n")
    print(comparison_table(cells, thresholds).to_text())
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    regressed = [c for c in cells if c.regressed]
    if regressed:
        print(f"\nREGRESSION: {len(regressed)} metric(s) beyond threshold: "
              + ", ".join(f"{c.group} {c.metric}" for c in regressed))
        return EXIT_REGRESSION
    print("\nno regression beyond thresholds" if thresholds else "\n(no thresholds given; nothing gated)")
    return EXIT_OK


def _cmd_sweep(args: argparse.Namespace) -> int:
    from loadtest.execute import RunOptions, TargetNotReady, run_scenario
    from loadtest.report_json import write_json
    from loadtest.sweep import run_sweep, sweep_document
    from loadtest.sweep_report import sweep_html, sweep_markdown, sweep_text

    scenario = _load(args.scenario)
    overrides = {k: getattr(args, k) for k in ("start_rps", "step_rps", "factor", "max_rps", "step_duration_s",
                                                "min_goodput_ratio", "max_error_ratio", "refine_steps")
                 if getattr(args, k) is not None}
    if scenario.trace is not None:
        raise ValueError("sweep sets its own rates; a trace replay has its own arrivals (use run --speedup)")
    spec = dataclasses.replace(scenario.sweep, **overrides)
    target = args.target or scenario.target
    started_at = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")

    def on_step(step) -> None:
        verdict = "pass" if step.passed else "FAIL: " + "; ".join(step.reasons)
        lat = step.report["overall"]["latency_ms"]
        print(f"sweep {step.rate_rps:g} req/s: p99 {lat.get('p99', '-')} ms, goodput "
              f"{step.report['overall']['goodput_ratio']:.1%} → {verdict}", file=sys.stderr)

    async def sweep_all():
        options = RunOptions(target, not args.no_progress, args.wait_ready_s, ca_file=args.ca_file)
        first = True

        async def run_step(step_scenario):
            nonlocal first
            opts = options if first else dataclasses.replace(options, wait_ready_s=0)
            first = False
            return await run_scenario(step_scenario, opts)

        return await run_sweep(scenario, spec, run_step, on_step)

    try:
        steps = _run_async(sweep_all())
    except TargetNotReady as err:
        print(f"loadtest: target {target} not ready: {err}", file=sys.stderr)
        return EXIT_NOT_READY
    doc = sweep_document(scenario, spec, steps, target=target, started_at=started_at)
    print(sweep_text(doc))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"sweep-{scenario.name}-{started_at.replace(':', '').replace('-', '').replace('+0000', 'Z')}"
    write_json(doc, args.out / f"{stem}.json")
    (args.out / f"{stem}.md").write_text(sweep_markdown(doc), encoding="utf-8")
    (args.out / f"{stem}.html").write_text(sweep_html(doc), encoding="utf-8")
    for ext in ("json", "md", "html"):
        print(f"{ext:>4} report: {args.out / f'{stem}.{ext}'}")
    return EXIT_OK


def _cmd_ab(args: argparse.Namespace) -> int:
    from loadtest.ab import ab_html, ab_markdown, ab_table
    from loadtest.execute import RunOptions, TargetNotReady, run_ab
    from loadtest.report_json import write_json

    if len(args.target) != 2:
        raise ValueError(f"ab needs --target twice (A, then B), got {len(args.target)}")
    scenario = _load(args.scenario)
    if args.duration_s is not None:
        scenario = scenario.with_duration(args.duration_s)
    options = RunOptions(args.target[0], not args.no_progress, args.wait_ready_s, ca_file=args.ca_file)
    try:
        doc = _run_async(run_ab(scenario, options, args.target[1], args.slice_s))
    except TargetNotReady as err:
        print(f"loadtest: a target is not ready: {err}", file=sys.stderr)
        return EXIT_NOT_READY
    print(ab_table(doc).to_text())
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"ab-{scenario.name}-{doc['meta']['started_at'].replace(':', '').replace('-', '').replace('+0000', 'Z')}"
    write_json(doc, args.out / f"{stem}.json")
    (args.out / f"{stem}.md").write_text(ab_markdown(doc), encoding="utf-8")
    (args.out / f"{stem}.html").write_text(ab_html(doc), encoding="utf-8")
    for ext in ("json", "md", "html"):
        print(f"{ext:>4} report: {args.out / f'{stem}.{ext}'}")
    return EXIT_OK


def _cmd_render(args: argparse.Namespace) -> int:
    from loadtest.execute import write_reports
    from loadtest.report_json import load_report
    from loadtest.report_text import terminal_summary

    doc = load_report(args.report)
    out = args.out or args.report.parent
    print(terminal_summary(doc))
    for kind, path in write_reports(doc, out, args.report.stem, ("md", "html")).items():
        print(f"{kind:>4} report: {path}")
    return EXIT_OK


def _run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)

