"""The knee of a brought ONNX CNN through the mesh against the same model under Ray Serve with
`@serve.batch` (issue 34's peer): the highest open-loop rate with p99 under 100 ms and no errors.

    .venv/bin/python -m bench.loadtest.bench_tensor_knee [--quick] [--start-rps 50] [--max-rps 3200]
                                                        [--step-s 5] [--warmup-s 1] [--refine-steps 3]
                                                        [--max-lag-ms 10] [--servers mesh,ray]

The model and both servers are bench_tensor_peer's (bench_tensor_batching's CNN, 3x32x32 FP32 in, 10
scores out, ONNX Runtime on one thread; the mesh batching up to 32 rows with a 2 ms queue delay, the
peer's `@serve.batch` up to 32 with a 5 ms wait). The driver is the project's load harness
(loadtest/), in this process: a `tensor` class of batch-1 ModelInfer requests over kserve+grpc, the
same 16 seeded inputs for both servers, Poisson arrivals, latency from each request's scheduled send
time (no coordinated omission), a 2 s deadline.

Both servers are started (the mesh first, then the peer) and stay up; their searches run at once with
their steps taking turns, one step at a time, so a busy minute of a shared machine lands on both ladders
rather than on one server's (the idle server's own background work, Ray's most, runs under the other's
steps too). Each server gets the same ladder: from --start-rps, doubling while a step passes (up to --max-rps),
then --refine-steps bisections between the highest pass and the lowest failure (bench/loadtest/knee.py).
A step is --warmup-s of warm-up then --step-s measured at one rate (longer at low rates, so that it
measures at least 500 requests, 200 in quick mode: a p99 of fewer is the maximum); it passes with
p99 < 100 ms and no errors. A step where the harness's own generator lag p99 exceeded --max-lag-ms is not
trusted (the harness fell behind, not the server) unless even its median service time broke the bound (a
server far past its knee, not a moment's stall of the shared machine, which also makes the generator
late) or the server refused requests (any error but DEADLINE_EXCEEDED and CANCELLED, a shed say): it is
run once more, and if it falls behind again it bounds the search like a failure but makes the knee a
lower bound. After a step that did not pass the server gets a pause to drain before the next.

--quick: from 100 req/s, 2 s steps, 0.5 s warm-up, 1 bisection, up to 1600 req/s: about 2 minutes with
both servers' start-up on a quiet box (Ray's start alone took ~60 s at load 15). `--servers mesh` and
`--servers ray` run one each; `--combine MESH.json RAY.json` sets two saved one-server runs side by side
(not interleaved, so only for a quiet machine). Prints every step and the knees, and writes
bench/results/tensor_knee.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from bench.harness.results import RESULTS_DIR, finite, write_report
from bench.harness.tables import markdown_table
from bench.loadtest.knee import (
    Criteria,
    Knee,
    Plan,
    Step,
    StepFigures,
    Verdict,
    find_knee,
    judge,
    knee_document,
    knee_from_document,
    knee_ratio,
    step_figures,
)
from loadtest.execute import RunOptions, run_scenario
from loadtest.scenario import Scenario, parse_scenario

RESULTS_PATH = RESULTS_DIR / "tensor_knee.json"
PRIME_S = 2.0  # unjudged load before a server's first step
LABELS = {"mesh": "mesh", "ray": "ray serve"}
MODEL = "bench-cnn"  # bench_tensor_batching.MODEL, not imported here so the pure parts load without torch


def scenario(rate_rps: float, step_s: float, warmup_s: float, max_lag_ms: float, seed: int = 7) -> Scenario:
    """One step: the CNN's input as a tensor class, at one Poisson rate."""
    return parse_scenario({
        "name": f"tensor-knee@{rate_rps:g}rps", "seed": seed, "duration_s": step_s, "warmup_s": warmup_s,
        "lag_warn_ms": max_lag_ms,
        "load": {"arrival": "poisson", "rate_rps": rate_rps},
        "tenants": [{"name": "bench", "api_key": "unused"}],  # both servers admit every caller here
        "classes": [{"name": "cnn", "kind": "tensor", "model": MODEL, "deadline_ms": 2000, "slo": {"e2e_ms": 100},
                     "tensor": {"num_variants": 16, "inputs": [
                         {"name": "x", "datatype": "FP32", "shape": [1, 3, 32, 32],
                          "values": {"dist": "normal", "mean": 0, "std": 1}}]}}],
    })


def step_runner(address: str, step_s: float, warmup_s: float, max_lag_ms: float, settle_s: float,
                criteria: Criteria, min_requests: int) -> Callable[[float], Coroutine[Any, Any, StepFigures]]:
    first = True
    last_passed = True

    async def run_step(rate_rps: float) -> StepFigures:
        nonlocal first, last_passed
        options = RunOptions(f"kserve+grpc://{address}", progress=False, wait_ready_s=0)
        if first:
            # Unjudged priming at the first rate: the first seconds of a fresh server (its first batches,
            # connections, the runtime's first calls) are not its steady state.
            await run_scenario(scenario(rate_rps, PRIME_S, 0.0, max_lag_ms),
                               dataclasses.replace(options, wait_ready_s=60))
            first = False
        if not last_passed:
            await asyncio.sleep(settle_s)  # let the server drain what the overloaded step left queued
        # Long enough for a p99 worth the name: with fewer than ~100 requests it is the maximum.
        measured_s = max(step_s, min_requests / rate_rps)
        report = await run_scenario(scenario(rate_rps, measured_s, warmup_s, max_lag_ms), options)
        figures = dataclasses.replace(step_figures(rate_rps, report), load_1m=round(os.getloadavg()[0], 2))
        last_passed = judge(figures, criteria)[0] is Verdict.PASS
        return figures

    return run_step


def print_step(server: str, step: Step) -> None:
    f = step.figures
    why = f" ({'; '.join(step.reasons)})" if step.reasons else ""
    print(f"{server} {f.rate_rps:g} req/s: {f.num_requests} measured, {f.num_errors} errors, {f.throughput_rps:.0f}/s "
          f"done, p50 {_ms(f.p50_ms)} p99 {_ms(f.p99_ms)} max {_ms(f.max_ms)} svc p50 {_ms(f.service_p50_ms)} "
          f"p99 {_ms(f.service_p99_ms)} ms, "
          f"generator lag p99 {f.lag_p99_ms:.1f} max {f.lag_max_ms:.1f} ms, load {f.load_1m} -> {step.verdict.value}{why}",
          flush=True)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def steps_table(knees: dict[str, Knee]) -> str:
    return markdown_table(
        ("server", "req/s offered", "measured", "errors", "done/s", "p50 ms", "p99 ms", "max ms", "svc p50 ms", "svc p99 ms",
         "lag p99 ms", "lag max ms", "load 1m", "verdict"),
        [(name, s.figures.rate_rps, s.figures.num_requests, s.figures.num_errors, s.figures.throughput_rps,
          _ms(s.figures.p50_ms), _ms(s.figures.p99_ms), _ms(s.figures.max_ms), _ms(s.figures.service_p50_ms),
          _ms(s.figures.service_p99_ms),
          s.figures.lag_p99_ms, s.figures.lag_max_ms, "-" if s.figures.load_1m is None else s.figures.load_1m,
          s.verdict.value)
         for name, knee in knees.items() for s in sorted(knee.steps, key=lambda s: s.figures.rate_rps)])


def knees_table(knees: dict[str, Knee]) -> str:
    return markdown_table(("server", "knee req/s", "first failing req/s", "bounded by"),
                          [(name, "-" if k.knee_rps is None else k.knee_rps,
                            "-" if k.first_failing_rps is None else k.first_failing_rps, k.bounded_by)
                           for name, k in knees.items()])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="from 100 req/s, 2 s steps, 0.5 s warm-up, 1 bisection, <= 1600 req/s")
    parser.add_argument("--start-rps", type=float, default=None, help="default 50 (quick: 100)")
    parser.add_argument("--max-rps", type=float, default=None, help="default 3200 (quick: 1600)")
    parser.add_argument("--step-s", type=float, default=None, help="measured seconds a step (default 5; quick: 2)")
    parser.add_argument("--warmup-s", type=float, default=None, help="warm-up a step (default 1; quick: 0.5)")
    parser.add_argument("--refine-steps", type=int, default=None, help="bisections (default 3; quick: 1)")
    parser.add_argument("--p99-ms", type=float, default=100.0)
    parser.add_argument("--max-lag-ms", type=float, default=10.0, help="generator lag p99 a step may have")
    parser.add_argument("--servers", default="mesh,ray", help="which to run: mesh, ray or both")
    parser.add_argument("--combine", type=Path, nargs=2, metavar=("MESH.json", "RAY.json"),
                        help="run nothing: set two saved one-server runs side by side (tables, ratio, --output)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args(argv)
    if args.combine:
        docs = [json.loads(path.read_text(encoding="utf-8")) for path in args.combine]
        saved = {name: knee_from_document(doc["servers"][name]) for doc in docs for name in doc["servers"]}
        if set(saved) != {"mesh", "ray serve"}:
            raise SystemExit(f"--combine needs one run with the mesh and one with Ray Serve, got {sorted(saved)}")
        meta = {k: v for k, v in docs[0].items() if k not in ("servers", "load_1m", "mesh_over_peer", "ratio_reading")}
        meta["load_1m"] = {" + ".join(doc["servers"]): doc["load_1m"] for doc in docs}
        meta["combined_from"] = [str(path) for path in args.combine]
        _report(saved, Criteria(**docs[0]["criteria"]), meta, args.output)
        return
    quick = args.quick
    step_s = args.step_s or (2.0 if quick else 5.0)
    warmup_s = args.warmup_s if args.warmup_s is not None else (0.5 if quick else 1.0)
    refine = args.refine_steps if args.refine_steps is not None else (1 if quick else 3)
    plan = Plan(args.start_rps or (100.0 if quick else 50.0), args.max_rps or (1600.0 if quick else 3200.0),
                refine_steps=refine)
    criteria = Criteria(p99_ms=args.p99_ms, max_lag_p99_ms=args.max_lag_ms)
    settle_s = 1.0 if quick else 3.0
    min_requests = 200 if quick else 500
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or set(servers) - {"mesh", "ray"}:
        raise SystemExit(f"--servers: mesh and/or ray, got {args.servers!r}")

    from bench.loadtest.bench_tensor_peer import PEER_PYTHON, running_peer
    from bench.worker.bench_tensor_batching import export_cnn, import_cnn

    if "ray" in servers and not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run tests/integration/test_loadtest_peer.py once to build it")
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_name, contextlib.ExitStack() as stack:
        tmp = Path(tmp_name)
        repository = tmp / "repo"
        import_cnn(export_cnn(tmp), repository)
        print(f"model exported and imported after {time.monotonic() - began:.0f} s", flush=True)
        addresses: dict[str, str] = {}
        for name in servers:  # one after the other: two starting at once slowed both past their waits on 2 cores
            (tmp / name).mkdir()
            addresses[LABELS[name]] = stack.enter_context(
                _running_mesh(tmp / name, repository) if name == "mesh" else running_peer(tmp / name, repository))
            print(f"{LABELS[name]} serving after {time.monotonic() - began:.0f} s", flush=True)
        load = {"before": round(os.getloadavg()[0], 2)}

        def runner(address: str) -> Callable[[float], Coroutine[Any, Any, StepFigures]]:
            return step_runner(address, step_s, warmup_s, args.max_lag_ms, settle_s, criteria, min_requests)

        knees = _run(search_all(addresses, plan, criteria, runner))
        load["after"] = round(os.getloadavg()[0], 2)
    print(f"took {time.monotonic() - began:.0f} s; load average (1 min) before and after the steps: {load}")
    _report(knees, criteria, {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "quick": quick, "model": MODEL, "transport": "kserve+grpc ModelInfer, batch 1, FP32 [1, 3, 32, 32]",
        "arrival": "poisson", "step_s": step_s, "min_requests_per_step": min_requests, "warmup_s": warmup_s,
        "plan": {"start_rps": plan.start_rps, "max_rps": plan.max_rps, "factor": plan.factor,
                 "refine_steps": plan.refine_steps, "behind_retries": plan.behind_retries},
        "criteria": {"p99_ms": criteria.p99_ms, "max_lag_p99_ms": criteria.max_lag_p99_ms,
                     "max_errors": criteria.max_errors},
        "load_1m": load,
    }, args.output)


def _report(knees: dict[str, Knee], criteria: Criteria, meta: dict, output: Path) -> None:
    """Prints the step and knee tables and the ratio; writes `meta` with them as JSON."""
    print("\n" + steps_table(knees))
    print("\n" + knees_table(knees))
    ratio, reading = knee_ratio(knees["mesh"], knees["ray serve"]) if len(knees) == 2 else (None, "unknown")
    if ratio is not None:
        print(f"\nmesh / Ray Serve knee: {'' if reading == 'exact' else reading + ' '}{ratio:.2f}x (target >= 3x; "
              f"p99 < {criteria.p99_ms:g} ms, no errors, generator lag p99 <= {criteria.max_lag_p99_ms:g} ms)")
    write_report(output, finite({**meta, "servers": {name: knee_document(k) for name, k in knees.items()},
                                 "mesh_over_peer": ratio, "ratio_reading": reading}))


async def search_all(addresses: dict[str, str], plan: Plan, criteria: Criteria,
                     runner: Callable[[str], Callable[[float], Coroutine[Any, Any, StepFigures]]]) -> dict[str, Knee]:
    """Every server's search at once, their steps taking turns (one at a time: asyncio.Lock wakes its
    waiters in order), so a busy minute of a shared machine falls on both ladders, not on one."""
    turn = asyncio.Lock()

    async def search(label: str, address: str) -> Knee:
        run_step = runner(address)

        async def in_turn(rate_rps: float) -> StepFigures:
            async with turn:
                return await run_step(rate_rps)

        return await find_knee(plan, criteria, in_turn, lambda step: print_step(label, step))

    knees = await asyncio.gather(*(search(label, address) for label, address in addresses.items()))
    return dict(zip(addresses, knees, strict=True))


@contextlib.contextmanager
def _running_mesh(tmp: Path, repository: Path) -> Iterator[str]:
    """bench_tensor_batching's batching mesh (plaintext, anonymous callers); yields the gateway's address."""
    from bench.worker.bench_tensor_batching import BATCHED
    from tools.testbed.processes import running_mesh

    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    with running_mesh(tmp, env=env, tls=False) as mesh:
        mesh.start_scheduler(*BATCHED)
        mesh.start_worker(MODEL, "--model-repository", str(repository), "--num-threads", "1")
        yield mesh.start_gateway("--allow-anonymous").address


def _run(coroutine: Coroutine[Any, Any, dict[str, Knee]]) -> dict[str, Knee]:
    """On uvloop, as `loadtest run` drives its targets."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


if __name__ == "__main__":
    main()
