"""Shadow traffic costs the primary nothing below capacity: primary latency with shadow off and on.

    .venv/bin/python -m bench.gateway.bench_shadow [--quick] [--rate-per-s 200] [--round-s 15] [--num-pairs 5]

Starts a plaintext mesh on 127.0.0.1 (scheduler, mock-classifier version 1 and an identical
version 2, each on its own worker, a gateway whose routing file gives the model a rollout held at
its shadow step with 100 % of requests mirrored) and drives an open-loop classify load from this
process: request i is sent at t0 + i / rate whether or not earlier ones have answered. Rounds
alternate shadow off (the rollout paused by Admin/ControlRollout: nothing mirrored) and shadow on
(resumed: every version-less request is mirrored to version 2 after version 1 answered).

Per round: the primary's p50 / p99 (from the moment the request was sent), errors, the gateway's
CPU per request (/proc/<pid>/stat user + system over the round, divided by the requests sent;
mirrored calls are the gateway's own work, so they are in it), the load generator's lag (how late
each send was against its schedule: when it grows, the client, not the mesh, is the bottleneck and
the round's latencies are suspect), and the shadow calls the gateway counted
(infermesh_gateway_shadow_requests_total by outcome). The summary compares the medians over the
rounds of each mode: p50 and p99 ratio on / off.

Only the analysis checks that could move the rollout off its shadow step are turned off (latency,
errors, deadline misses; agreement stays on, and version 2 agrees), and the step's minimums are
out of reach, so the shadow stays on for the whole run; a round that saw no mirrored call while it
should have is reported as such.

Prints a table (also as markdown, for docs/operations.md) and writes ``bench/results/shadow.json``
(``shadow_quick.json`` with --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import yaml

from bench.harness.cpu import cpu_seconds
from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.stats import quantile
from infermesh.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.processes import ServiceProcess, free_port, running_mesh, wait_until

MODEL = "mock-classifier"
PROFILE = "batch_ms=4"
SHADOW_OUTCOMES = ("agreed", "disagreed", "failed", "shed")


def routing_yaml() -> str:
    rollout = {"canary_version": "2", "steps": ["shadow", 100], "shadow_percent": 100, "shadow_max_in_flight": 64,
               "min_requests": 1_000_000, "min_duration_s": 86_400,
               "checks": {"latency": False, "error_rate": False, "deadline_misses": False}}
    return yaml.safe_dump({"models": {MODEL: {"default_version": "1", "versions": {"1": {}, "2": {}},
                                              "rollout": rollout}}})


def request(seed: int) -> gateway_pb2.ClassifyRequest:
    pixels = seed.to_bytes(4, "little")
    return gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=MODEL), image=common_pb2.Image(
        raw=common_pb2.RawImage(pixels=pixels, height=2, width=2, channels=1)))


@dataclass(frozen=True)
class Round:
    index: int
    shadow: bool
    num_requests: int
    num_errors: int
    p50_ms: float
    p99_ms: float
    gateway_cpu_us_per_request: float
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    shadow_calls: dict[str, float]


def _shadow_counts(metrics_port: int) -> dict[str, float]:
    metrics = scrape(metrics_port)
    return {o: metrics.value("infermesh_gateway_shadow_requests_total", model=MODEL, version="2", outcome=o) or 0.0
            for o in SHADOW_OUTCOMES}


async def open_loop(stub, rate_per_s: float, duration_s: float, first_seed: int
                    ) -> tuple[list[float], list[float], int]:
    """Send at a fixed rate for duration_s; (latencies_s of OK answers, send lags_s, errors)."""
    latencies, lags, errors = [], [], 0
    loop = asyncio.get_running_loop()

    async def one(seed: int) -> None:
        nonlocal errors
        sent = loop.time()
        try:
            await stub.Classify(request(seed), timeout=10)
            latencies.append(loop.time() - sent)
        except grpc.aio.AioRpcError:
            errors += 1

    tasks = []
    start = loop.time()
    for i in range(int(rate_per_s * duration_s)):
        due = start + i / rate_per_s
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        lags.append(max(0.0, loop.time() - due))
        tasks.append(asyncio.create_task(one(first_seed + i)))
    await asyncio.gather(*tasks)
    return latencies, lags, errors


async def control(admin, action: str) -> str:
    reply = await admin.ControlRollout(admin_pb2.ControlRolloutRequest(model=MODEL, action=action), timeout=10)
    return reply.state


async def run_rounds(gateway: ServiceProcess, metrics_port: int, args) -> list[Round]:
    rounds = []
    assert gateway.proc is not None, "the gateway is started"
    pid = gateway.proc.pid
    async with grpc.aio.insecure_channel(gateway.address) as channel:
        stub, admin = gateway_pb2_grpc.InferenceStub(channel), admin_pb2_grpc.AdminStub(channel)
        await open_loop(stub, args.rate_per_s, args.warmup_s, first_seed=0)  # channels, batches, caches
        for index in range(2 * args.num_pairs):
            shadow = index % 2 == 1
            action = "ACTION_RESUME" if shadow else "ACTION_PAUSE"
            state = await control(admin, action)
            assert state == ("running" if shadow else "paused"), f"the rollout is {state}"
            await asyncio.sleep(0.5)  # mirrored calls of the round before drain
            before_shadow, before_cpu_s = _shadow_counts(metrics_port), cpu_seconds(pid)
            latencies, lags, errors = await open_loop(stub, args.rate_per_s, args.round_s,
                                                      first_seed=(index + 1) * 1_000_000)
            used_cpu_s = cpu_seconds(pid) - before_cpu_s
            after_shadow = _shadow_counts(metrics_port)
            num = len(latencies) + errors
            rounds.append(Round(
                index=index, shadow=shadow, num_requests=num, num_errors=errors,
                p50_ms=quantile(latencies, 0.5) * 1e3, p99_ms=quantile(latencies, 0.99) * 1e3,
                gateway_cpu_us_per_request=used_cpu_s / max(num, 1) * 1e6,
                lag_p50_ms=quantile(lags, 0.5) * 1e3, lag_p99_ms=quantile(lags, 0.99) * 1e3,
                lag_max_ms=max(lags) * 1e3,
                shadow_calls={o: after_shadow[o] - before_shadow[o] for o in SHADOW_OUTCOMES}))
            print(_row(rounds[-1]), flush=True)
    return rounds


def _row(r: Round) -> str:
    mirrored = int(sum(r.shadow_calls.values()))
    return (f"round {r.index:2d} shadow {'on ' if r.shadow else 'off'}  n={r.num_requests:5d} err={r.num_errors:3d}  "
            f"p50 {r.p50_ms:6.2f} ms  p99 {r.p99_ms:6.2f} ms  gateway {r.gateway_cpu_us_per_request:6.0f} us/req  "
            f"lag p99 {r.lag_p99_ms:5.2f} max {r.lag_max_ms:6.2f} ms  mirrored {mirrored} "
            f"(agreed {int(r.shadow_calls['agreed'])}, shed {int(r.shadow_calls['shed'])})")


def summarize(rounds: list[Round]) -> dict:
    def median(shadow: bool, name: str) -> float:
        return statistics.median(getattr(r, name) for r in rounds if r.shadow is shadow)

    names = ("p50_ms", "p99_ms", "gateway_cpu_us_per_request", "lag_p99_ms")
    off = {n: median(False, n) for n in names}
    on = {n: median(True, n) for n in names}
    return {"off": off, "on": on, "ratio_on_off": {n: on[n] / off[n] if off[n] else float("nan") for n in names}}


def markdown(summary: dict, args) -> str:
    labels = {"p50_ms": "primary p50 (ms)", "p99_ms": "primary p99 (ms)",
              "gateway_cpu_us_per_request": "gateway CPU per request (µs)", "lag_p99_ms": "load generator lag p99 (ms)"}
    lines = [f"| {args.rate_per_s:g} req/s, {args.num_pairs} × 2 rounds of {args.round_s:g} s (medians) "
             "| shadow off | shadow on (100 %) | on / off |", "| --- | ---: | ---: | ---: |"]
    for name, label in labels.items():
        lines.append(f"| {label} | {summary['off'][name]:.2f} | {summary['on'][name]:.2f} | "
                     f"{summary['ratio_on_off'][name]:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 pairs of 4 s rounds at 150 req/s")
    parser.add_argument("--rate-per-s", type=float, default=200.0)
    parser.add_argument("--round-s", type=float, default=15.0)
    parser.add_argument("--num-pairs", type=int, default=5, help="rounds: shadow off, on, off, on, ...")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    args = parser.parse_args()
    if args.quick:
        args.rate_per_s, args.round_s, args.num_pairs, args.warmup_s = 150.0, 4.0, 3, 2.0
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as tmp_dir, \
            running_mesh(Path(tmp_dir), tls=False) as mesh:
        tmp = Path(tmp_dir)
        routing = tmp / "routing.yaml"
        routing.write_text(routing_yaml(), encoding="utf-8")
        metrics_port = free_port()
        mesh.start_scheduler()
        for version in ("1", "2"):
            mesh.start_worker(MODEL, "--mock-profile", PROFILE, "--model-version", version)
        gateway = mesh.start_gateway("--routing-file", str(routing), "--rollout-state-file", str(tmp / "state.json"),
                                     "--metrics-port", str(metrics_port))
        with grpc.insecure_channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            wait_until(lambda: all(stub.Classify(gateway_pb2.ClassifyRequest(
                model=common_pb2.ModelRef(name=MODEL, version=v), image=request(0).image), timeout=10)
                .model.version == v for v in ("1", "2")), timeout_s=30, message="both versions serving")
        time.sleep(1.0)  # one pressure poll: the gateway knows who serves version 2
        rounds = asyncio.run(run_rounds(gateway, metrics_port, args))
    summary = summarize(rounds)
    table = markdown(summary, args)
    print()
    print(table)
    result = {"benchmark": "shadow", "quick": args.quick, "rate_per_s": args.rate_per_s, "round_s": args.round_s,
              "num_pairs": args.num_pairs, "mock_profile": PROFILE, "platform": platform.platform(),
              "python": sys.version.split()[0], "num_cpus": os.cpu_count(),
              "rounds": [asdict(r) for r in rounds], "summary": summary, "markdown": table}
    print()
    write_report(RESULTS_DIR / ("shadow_quick.json" if args.quick else "shadow.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
