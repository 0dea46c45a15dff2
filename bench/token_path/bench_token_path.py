"""The token fast path: scheduler and gateway CPU per token, and end to end against request-level batching.

    .venv/bin/python -m bench.token_path.bench_token_path [--quick] [--runs 3] [--only scheduler,gateway,e2e]
                                               [--profile-s 20]

Parts (each run measures every part asked for; the table shows medians and every run):

  scheduler  one scheduler + 4 mock-generator workers (2 ms steps on a timer, 64 sequences and 4096
             KV blocks each), 256 Generate calls kept open on one Submit stream from this process
             (bench/token_path/clients.py). Tokens/s delivered to the client, scheduler CPU us per
             token (user+system from /proc/<pid>/stat over the window), and the client's and the
             workers' CPU, so a reader can tell who was the bottleneck.
  gateway    the same mesh plus two gateways (--upstream-mode stream, and unary as info), driven in
             turn by 64 closed-loop Generate streams of 256 tokens: gateway CPU us per streamed token,
             one token per message ("stream", "unary") and with stream coalescing asked for
             ("coalesced": GenerateRequest.stream.max_tokens_per_chunk = 8, stream mode).
  e2e        tinylm through a `make up`-like mesh (scheduler, gateway in stream mode, one tinylm
             worker with --num-threads 1; one critical tenant, like make up's alpha, with generous quotas) against bench/token_path/request_level_baseline.py
             (one process, the worker's StepExecutor, batches of 32, 1 torch thread) on the same
             requests (bench/token_path/workload.py): open-loop Poisson 5/s, 20/s and 30/s (e2e
             p50/p99 from the scheduled send; 30/s saturates both, and its tokens/s from the schedule's
             start to the last reply is the saturation figure), and a closed loop of 48 clients (info;
             tokens of the streams that ended in the window over the window).
             The mesh runs as shipped and again with the gateway's adaptive concurrency limit pinned
             at 1024 (info). Mesh variants and baseline run one after the other, in reversed order
             every other run.

--profile-s: in the first run, py-spy (must be on PATH or in .venv/bin) records the scheduler during
extra scheduler windows, and the stream gateway during extra gateway windows: one with Python frames
only, one with --native (C frames too); the top functions by self share, total share and "owner"
(each sample charged to its innermost services/ frame) go into the JSON and the tables, the
speedscope files into bench/results/token_path_profiles/. The measured windows are never profiled.

Every part records os.getloadavg() at its start: the 2 cores are shared, figures are noisy.
Prints tables and writes bench/results/token_path.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.harness.cpu import cpu_seconds
from bench.harness.load_plan import LoadPlan, RequestTemplate, Rpc, Send
from bench.harness.load_pool import ClosedLoopJob, LoadPool
from bench.harness.mesh_ready import TINYLM_MAX_NUM_SEQS, WORKER_ENV, wait_attached
from bench.harness.results import MODEL_REPO, RESULTS_DIR, ROOT, write_report
from bench.harness.send_result import SendResult
from bench.token_path.clients import SubmitWindow, drive_gateway, drive_submit
from bench.token_path.e2e_tenant import E2E_API_KEY, E2E_TENANT
from bench.token_path.report import (
    Target,
    e2e_figures,
    median_of,
    rate_window_s,
    ratio,
    speedscope_owners,
    speedscope_top,
    us_per_token,
)
from bench.token_path.workload import LoadPhase, TokenRequest
from infermesh.v1 import common_pb2, gateway_pb2
from tools.testbed.gateway_fixtures import spawn_gateway, write_tenants
from tools.testbed.processes import Mesh, running_mesh

RESULTS_PATH = RESULTS_DIR / "token_path.json"
PROFILES_DIR = RESULTS_DIR / "token_path_profiles"  # speedscope files (speedscope.app)
PARTS = ("scheduler", "gateway", "e2e")
NUM_MOCK_WORKERS = 4
MOCK_SEQS_PER_WORKER = 64
MOCK_PROFILE = (f"step_ms=2,max_num_seqs={MOCK_SEQS_PER_WORKER},num_kv_blocks=4096,max_num_batched_tokens=4096,"
                "block_size=16,max_seq_len=1024")
SCHEDULER_MAX_TOKENS = 128
GATEWAY_STREAMS = 64
GATEWAY_MAX_TOKENS = 256
# The coalesced case asks for GenerateRequest.stream.max_tokens_per_chunk = 8 (as bench_upstream's generate_k8).
COALESCE_TOKENS_PER_CHUNK = 8
# The adaptive limit starts at 64 per model (standard traffic may fill 0.9 of it): raised so the
# gateway part measures streaming, not admission refusals.
GATEWAY_ARGS = ("--log-level", "WARNING", "--limit-initial", "1024")
E2E_CONCURRENCY = 48
E2E_DEADLINE_S = 300.0
# The mesh as shipped, and with the gateway's adaptive concurrency limit pinned high (info): the
# shipped limit refuses streams once their latency grows (RESOURCE_EXHAUSTED "adaptive limit").
MESH_VARIANTS = {"mesh": (), "mesh_no_limit": ("--limit-initial", "1024", "--limit-min", "1024")}
TARGETS = {
    "scheduler_us_per_token": Target("scheduler CPU per token", "<=", 20, " us"),
    "scheduler_tokens_per_s": Target("tokens/s from one scheduler (4 x 64 mock sequences)", ">=", 20_000),
    "gateway_coalesced_us_per_token": Target("gateway CPU per streamed token, coalescing on", "<=", 20, " us"),
    "gateway_us_per_token": Target("gateway CPU per streamed token, 1 token a message", "<=", 60, " us"),
    "saturation_ratio": Target("e2e saturation (30/s) tokens/s, mesh / baseline", ">=", 1.5, "x"),
    "p50_ratio_5": Target("e2e p50 at 5/s, mesh / baseline", "<=", 1.1, "x"),
    "saturation_ratio_no_limit": Target("the same, adaptive limit pinned high (info)", ">=", 1.5, "x"),
    "p50_ratio_5_no_limit": Target("the same, adaptive limit pinned high (info)", "<=", 1.1, "x"),
    "closed_ratio": Target(f"closed loop of {E2E_CONCURRENCY} tokens/s, mesh / baseline (info)", ">=", 1.5, "x"),
    "closed_ratio_no_limit": Target("the same, adaptive limit pinned high (info)", ">=", 1.5, "x"),
}


@dataclass(frozen=True)
class Settings:
    warmup_s: float
    window_s: float  # scheduler and gateway windows
    open_loop_s: float  # e2e open-loop schedules
    saturated_s: float  # e2e 30/s schedule and closed loop
    profile_s: float  # 0: no profile

    def phases(self, seed: int) -> list[LoadPhase]:
        return [LoadPhase("5/s", self.open_loop_s, seed, rate_per_s=5.0),
                LoadPhase("20/s", self.open_loop_s, seed + 1, rate_per_s=20.0),
                LoadPhase("30/s", self.saturated_s, seed + 2, rate_per_s=30.0),
                LoadPhase(f"closed {E2E_CONCURRENCY}", self.saturated_s, seed + 3, concurrency=E2E_CONCURRENCY)]


FULL = Settings(warmup_s=2.0, window_s=10.0, open_loop_s=30.0, saturated_s=20.0, profile_s=20.0)
QUICK = Settings(warmup_s=1.5, window_s=5.0, open_loop_s=15.0, saturated_s=10.0, profile_s=10.0)


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_meter(pids: dict[str, int], into: dict[str, float]) -> Callable[[], Callable[[], None]]:
    """A window-start callback: reads each pid's CPU seconds, and returns the window-end callback
    that writes each one's CPU seconds over the window into `into`."""
    def start() -> Callable[[], None]:
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}

        def stop() -> None:
            into.update({name: cpu_seconds(pid) - before[name] for name, pid in pids.items()})
        return stop
    return start


def _py_spy() -> str | None:
    return shutil.which("py-spy") or next((str(p) for p in [Path(sys.executable).parent / "py-spy"] if p.exists()),
                                          None)


def profiled(pid: int, duration_s: float, out_path: Path, native: bool) -> Callable[[], Callable[[], None]]:
    """A window-start callback that runs py-spy on `pid` for `duration_s`; the end callback waits for it.

    native: also C frames. Most of a gateway's time is in grpc's Cython core, uvloop and system
    calls, which Python frames alone show as self time of the event loop's run()."""
    def start() -> Callable[[], None]:
        proc = subprocess.Popen([_py_spy(), "record", "--pid", str(pid), "-d", str(int(duration_s)), "--rate", "100",
                                 *(["--native"] if native else []), "--format", "speedscope", "-o", str(out_path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def stop() -> None:
            proc.wait(timeout=duration_s + 30)
        return stop
    return start


PROFILE_KINDS = {"python": False, "native": True}


def profile_windows(drive: Callable[[float, float, Callable], object], pid: int, duration_s: float,
                    profile_dir: Path, part: str) -> dict:
    """One extra window of load per profile kind, py-spy on `pid` during it; the summaries by kind."""
    summaries = {}
    for kind, native in PROFILE_KINDS.items():
        path = profile_dir / f"{part}-{kind}.speedscope.json"
        drive(1.0, duration_s + 0.5, profiled(pid, duration_s, path, native))
        summaries[kind] = profile_summary(path)
    return summaries


def profile_summary(path: Path, num_self: int = 25, num_total: int = 40) -> dict:
    """Top functions by self share, and by total share (more rows: the outer frames of every stack,
    from runpy to the event loop, fill the first ones)."""
    if not path.exists():
        return {"error": f"py-spy wrote no {path}"}
    doc = json.loads(path.read_text())
    num_samples, by_self, _ = speedscope_top(doc, num_self)
    _, _, by_total = speedscope_top(doc, num_total)
    return {"num_samples": num_samples, "file": str(path), "by_self": [asdict(f) for f in by_self],
            "by_total": [asdict(f) for f in by_total],
            "by_owner": [{"name": name, "share": share} for name, share in speedscope_owners(doc, num_self)]}


# -- scheduler and gateway: mock workers --------------------------------------------------


def _start_mock_mesh(mesh: Mesh) -> None:
    mesh.start_scheduler("--log-level", "WARNING")
    for i in range(NUM_MOCK_WORKERS):
        mesh.start_worker("mock-generator", "--mock-profile", MOCK_PROFILE, "--log-level", "WARNING",
                          name=f"mock-{i}")
    wait_attached(mesh.scheduler.address, NUM_MOCK_WORKERS)


def _window_figures(window: SubmitWindow, cpu_s: dict[str, float]) -> dict:
    return {
        **asdict(window),
        "tokens_per_s": round(window.num_tokens / window.window_s, 1),
        "cpu_cores": {name: round(s / window.window_s, 3) for name, s in cpu_s.items()},
        "cpu_us_per_token": {name: round(us_per_token(s, window.num_tokens), 2) for name, s in cpu_s.items()},
    }


def scheduler_part(settings: Settings, profile_dir: Path | None) -> dict:
    load_average = _load_average()
    with tempfile.TemporaryDirectory(prefix="bench-token-path-") as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        _start_mock_mesh(mesh)
        workers = [p for p in mesh.processes if p.service == "worker"]
        pids = {"scheduler": mesh.scheduler.proc.pid, "client": os.getpid(),
                **{w.name: w.proc.pid for w in workers}}
        cpu_s: dict[str, float] = {}
        num_streams = NUM_MOCK_WORKERS * MOCK_SEQS_PER_WORKER
        window = asyncio.run(drive_submit(mesh.scheduler.address, "mock-generator", num_streams, SCHEDULER_MAX_TOKENS,
                                          settings.warmup_s, settings.window_s, cpu_meter(pids, cpu_s)))
        figures = _window_figures(window, cpu_s)
        figures["cpu_cores"]["workers"] = round(sum(cpu_s[w.name] for w in workers) / window.window_s, 3)
        if profile_dir is not None:
            figures["profile"] = profile_windows(
                lambda warmup_s, window_s, on_start: asyncio.run(drive_submit(
                    mesh.scheduler.address, "mock-generator", num_streams, SCHEDULER_MAX_TOKENS, warmup_s, window_s,
                    on_start)),
                mesh.scheduler.proc.pid, settings.profile_s, profile_dir, "scheduler")
    return {"load_average": load_average, "num_streams": num_streams, "max_tokens": SCHEDULER_MAX_TOKENS, **figures}


def gateway_part(settings: Settings, profile_dir: Path | None) -> dict:
    load_average = _load_average()
    modes = {}
    with tempfile.TemporaryDirectory(prefix="bench-token-path-") as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        _start_mock_mesh(mesh)
        gateways = {mode: spawn_gateway(mesh, f"gateway-{mode}", "--upstream-mode", mode, *GATEWAY_ARGS)
                    for mode in ("stream", "unary")}
        cases = {"stream": (gateways["stream"], 0), "coalesced": (gateways["stream"], COALESCE_TOKENS_PER_CHUNK),
                 "unary": (gateways["unary"], 0)}
        for case, (gateway, tokens_per_chunk) in cases.items():
            pids = {"gateway": gateway.proc.pid, "scheduler": mesh.scheduler.proc.pid, "client": os.getpid()}
            cpu_s: dict[str, float] = {}
            window = asyncio.run(drive_gateway(gateway.address, "mock-generator", GATEWAY_STREAMS, GATEWAY_MAX_TOKENS,
                                               settings.warmup_s, settings.window_s, cpu_meter(pids, cpu_s),
                                               tokens_per_chunk))
            modes[case] = _window_figures(window, cpu_s)
        if profile_dir is not None:
            modes["stream"]["profile"] = profile_windows(
                lambda warmup_s, window_s, on_start: asyncio.run(drive_gateway(
                    gateways["stream"].address, "mock-generator", GATEWAY_STREAMS, GATEWAY_MAX_TOKENS, warmup_s,
                    window_s, on_start)),
                gateways["stream"].proc.pid, settings.profile_s, profile_dir, "gateway")
    return {"load_average": load_average, "num_streams": GATEWAY_STREAMS, "max_tokens": GATEWAY_MAX_TOKENS,
            "coalesced_tokens_per_chunk": COALESCE_TOKENS_PER_CHUNK, **modes}


# -- e2e: tinylm ---------------------------------------------------------------------------


def _templates(requests: tuple[TokenRequest, ...]) -> tuple[RequestTemplate, ...]:
    return tuple(RequestTemplate(Rpc.GENERATE, gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name="tinylm"), prompt=r.prompt,
        sampling=common_pb2.SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)).SerializeToString(),
        api_key=E2E_API_KEY, tenant="mesh", deadline_s=E2E_DEADLINE_S) for r in requests)


def _mesh_phase(pool: LoadPool, address: str, phase: LoadPhase, pids: dict[str, int]) -> dict:
    requests = phase.requests()
    templates = _templates(requests)
    load_average = _load_average()
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    if phase.open_loop:
        plan = LoadPlan(templates, tuple(Send(r.scheduled_s, i) for i, r in enumerate(requests)), phase.duration_s)
        results = pool.replay(address, plan, 1)
        elapsed_s = max((r.done_s for r in results), default=0.0)
    else:
        results, elapsed_s = pool.closed_loop(address, ClosedLoopJob(templates, phase.concurrency, phase.duration_s))
    cpu_s = {name: round(cpu_seconds(pid) - before[name], 2) for name, pid in pids.items()}
    window_s = rate_window_s(phase.open_loop, phase.duration_s, elapsed_s)
    return {"phase": phase.name, "load_average": load_average, "elapsed_s": round(elapsed_s, 2),
            "rate_window_s": round(window_s, 2), "cpu_s": cpu_s, **e2e_figures(results, window_s)}


def mesh_e2e(phases: list[LoadPhase], gateway_args: tuple[str, ...],
             max_num_seqs: int = TINYLM_MAX_NUM_SEQS) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-token-path-") as tmp, running_mesh(Path(tmp), tls=False) as mesh, \
            LoadPool(1) as pool:
        mesh.start_scheduler("--log-level", "WARNING")
        mesh.start_worker("tinylm", "--log-level", "WARNING", "--model-repository", str(MODEL_REPO),
                          "--num-threads", "1", "--max-num-seqs", str(max_num_seqs), env=WORKER_ENV)
        wait_attached(mesh.scheduler.address, 1)
        mesh.start_gateway("--log-level", "WARNING", "--tenants-file",
                           str(write_tenants(Path(tmp) / "tenants.yaml", [E2E_TENANT])), *gateway_args)
        pids = {p.name: p.proc.pid for p in mesh.processes}
        warm = LoadPhase("warm-up", 2.0, 1000, concurrency=8)
        pool.closed_loop(mesh.gateway.address, ClosedLoopJob(_templates(warm.requests()), 8, warm.duration_s))
        return [_mesh_phase(pool, mesh.gateway.address, phase, pids) for phase in phases]


def baseline_e2e(phases: list[LoadPhase]) -> list[dict]:
    env = {**os.environ, **WORKER_ENV, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, "-m", "bench.token_path.request_level_baseline", "--model-repo", str(MODEL_REPO),
                           "--phases-json", json.dumps([asdict(p) for p in phases])],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"baseline exited with {done.returncode}:\n{done.stderr[-3000:]}")
    reports = []
    for phase, report in zip(phases, json.loads(done.stdout), strict=True):
        results = [SendResult(**r) for r in report["results"]]
        window_s = rate_window_s(phase.open_loop, phase.duration_s, report["elapsed_s"])
        reports.append({"phase": phase.name, "load_average": [round(x, 2) for x in report["load_average"]],
                        "elapsed_s": round(report["elapsed_s"], 2), "rate_window_s": round(window_s, 2),
                        "cpu_s": {"baseline": round(report["cpu_s"], 2)},
                        "mean_running": round(report["mean_running"], 1), "num_steps": report["num_steps"],
                        **e2e_figures(results, window_s)})
    return reports


def e2e_part(settings: Settings, run_index: int) -> dict:
    phases = settings.phases(seed=1 + 10 * run_index)
    sides = {}
    order = [*MESH_VARIANTS, "baseline"]
    if run_index % 2:
        order.reverse()
    for side in order:
        _progress(f"  e2e: {side}")
        sides[side] = baseline_e2e(phases) if side == "baseline" else mesh_e2e(phases, MESH_VARIANTS[side])
    return {"order": order, **sides, "over_baseline": over_baseline(sides)}


def over_baseline(sides: dict[str, list[dict]]) -> dict:
    """Each mesh variant's figures over the baseline's, phase by phase (one run: same requests)."""
    return {variant: {mesh["phase"]: {"e2e_p50": ratio(mesh["e2e_p50_ms"], base["e2e_p50_ms"]),
                                      "e2e_p99": ratio(mesh["e2e_p99_ms"], base["e2e_p99_ms"]),
                                      "tokens_per_s": ratio(mesh["tokens_per_s"], base["tokens_per_s"])}
                      for mesh, base in zip(sides[variant], sides["baseline"], strict=True)}
            for variant in sides if variant != "baseline"}


# -- the run -------------------------------------------------------------------------------


def run_once(settings: Settings, parts: list[str], run_index: int, profile_dir: Path | None) -> dict:
    run: dict = {"run": run_index}
    for part in parts:
        _progress(f"run {run_index}: {part}")
        if part == "scheduler":
            run[part] = scheduler_part(settings, profile_dir)
        elif part == "gateway":
            run[part] = gateway_part(settings, profile_dir)
        else:
            run[part] = e2e_part(settings, run_index)
    return run


def headline(runs: list[dict]) -> dict:
    """The targets' figures: median over runs, and every run's value."""
    closed = f"closed {E2E_CONCURRENCY}"
    figures = {
        "scheduler_us_per_token": lambda r: r["scheduler"]["cpu_us_per_token"]["scheduler"],
        "scheduler_tokens_per_s": lambda r: r["scheduler"]["tokens_per_s"],
        "gateway_coalesced_us_per_token": lambda r: r["gateway"]["coalesced"]["cpu_us_per_token"]["gateway"],
        "gateway_us_per_token": lambda r: r["gateway"]["stream"]["cpu_us_per_token"]["gateway"],
        "saturation_ratio": lambda r: r["e2e"]["over_baseline"]["mesh"]["30/s"]["tokens_per_s"],
        "p50_ratio_5": lambda r: r["e2e"]["over_baseline"]["mesh"]["5/s"]["e2e_p50"],
        "saturation_ratio_no_limit": lambda r: r["e2e"]["over_baseline"]["mesh_no_limit"]["30/s"]["tokens_per_s"],
        "p50_ratio_5_no_limit": lambda r: r["e2e"]["over_baseline"]["mesh_no_limit"]["5/s"]["e2e_p50"],
        "closed_ratio": lambda r: r["e2e"]["over_baseline"]["mesh"][closed]["tokens_per_s"],
        "closed_ratio_no_limit": lambda r: r["e2e"]["over_baseline"]["mesh_no_limit"][closed]["tokens_per_s"],
    }
    out = {}
    for key, figure in figures.items():
        median = median_of(runs, figure)
        out[key] = {"target": TARGETS[key].text, "median": median, "met": TARGETS[key].met(median),
                    "runs": [median_of([r], figure) for r in runs]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one run, shorter windows")
    parser.add_argument("--runs", type=int, default=None, help="runs (default 3, --quick 1)")
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {','.join(PARTS)}")
    parser.add_argument("--profile-s", type=float, default=None,
                        help="py-spy the scheduler and the gateway this long in the first run (0: no profile)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--retable", type=Path, default=None,
                        help="measure nothing: recompute the derived figures of this JSON, rewrite it, print tables")
    args = parser.parse_args()
    if args.retable:
        retable(args.retable)
        return
    settings = QUICK if args.quick else FULL
    if args.profile_s is not None:
        settings = replace(settings, profile_s=args.profile_s)
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--only: unknown parts {unknown}; choose from {','.join(PARTS)}")
    num_runs = args.runs or (1 if args.quick else 3)
    if settings.profile_s > 0 and _py_spy() is None:
        _progress("py-spy not found (pip install py-spy into .venv): no profile")
        settings = replace(settings, profile_s=0.0)
    runs = []
    if settings.profile_s > 0:
        PROFILES_DIR.mkdir(parents=True, exist_ok=True)
    for run_index in range(num_runs):
        profile_dir = PROFILES_DIR if run_index == 0 and settings.profile_s > 0 else None
        runs.append(run_once(settings, parts, run_index, profile_dir))
        _write(args.output, settings, runs)
    from bench.token_path.tables import print_tables
    print_tables(json.loads(args.output.read_text()))
    print(f"wrote {args.output}")


def retable(path: Path) -> None:
    """Recomputes closed-loop tokens/s over the window (JSONs written before rate_window_s divided by
    the time the clients took to finish), the ratios and the headline; every measured field stays."""
    doc = json.loads(path.read_text())
    for run in doc["runs"]:
        e2e = run.get("e2e")
        if not e2e:
            continue
        for side in [*e2e["over_baseline"], "baseline"]:
            for figures in e2e[side]:
                if figures["phase"].startswith("closed") and "rate_window_s" not in figures:
                    figures["rate_window_s"] = doc["settings"]["saturated_s"]
                    figures["tokens_per_s"] = round(figures["num_tokens"] / figures["rate_window_s"], 1)
        e2e["over_baseline"] = over_baseline({side: e2e[side] for side in [*e2e["over_baseline"], "baseline"]})
    doc["headline"] = headline(doc["runs"])
    write_report(path, doc, default=str)
    from bench.token_path.tables import print_tables
    print_tables(doc)


def _write(path: Path, settings: Settings, runs: list[dict]) -> None:
    """After every run, so a cut-off keeps what was measured."""
    write_report(path, {
        "benchmark": "token_path",
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": {**asdict(settings), "mock_profile": MOCK_PROFILE, "num_mock_workers": NUM_MOCK_WORKERS,
                     "e2e_concurrency": E2E_CONCURRENCY, "gateway_args": list(GATEWAY_ARGS)},
        "headline": headline(runs),
        "runs": runs,
    }, default=str)


if __name__ == "__main__":
    main()
