"""Gateway and scheduler CPU per classify request and per generated token: unary RPCs vs the Submit stream.

    .venv/bin/python -m bench.gateway.bench_upstream [--num-classify 3000] [--num-generate 96] [--max-tokens 64]
                                             [--concurrency 16] [--rounds 2] [--coalesce-k 8] [--no-classify] [--quick]

One toy mesh (scheduler, toy classifier and toy generator with no compute) and
two gateways on it, `--upstream-mode unary` and `--upstream-mode stream`,
driven in turn by a grpc.aio client in this process. CPU time of the gateway
and of the scheduler comes from /proc/<pid>/stat (bench/harness/cpu.py)
before and after each phase, minus each process's idle rate measured first.
Phases per mode:

  classify   admitted classify requests, end to end: CPU us per request
  generate   streams of --max-tokens tokens, --concurrency at once: CPU us per generated token
  generate_kK  the same streams asking for stream coalescing (GenerateRequest.stream.max_tokens_per_chunk
             = --coalesce-k; 0 leaves the phase out): CPU us per generated token, fewer messages per token

Rounds alternate the order of the modes (unary first, then stream first, ...), so
load from elsewhere drifting during a run does not favour one mode; the ratios
compare the modes' medians over the rounds.

The toy worker computes nothing, so these are the two Python hops' own costs.
The client shares the machine's cores, so the rates are lower bounds.
Prints a table and writes ``bench/results/upstream.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from bench.gateway.classify_load import drive
from bench.harness.cpu import busy_cpu_s, cpu_seconds, idle_rates
from bench.harness.results import RESULTS_DIR, write_report
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed.gateway_fixtures import spawn_gateway
from tools.testbed.processes import running_mesh

RESULTS_PATH = RESULTS_DIR / "upstream.json"
MODES = ("unary", "stream")
# The last drive_generate's failures by code, for its Phase.
LAST_FAILURES: Counter[str] = Counter()


@dataclass(frozen=True)
class Phase:
    round: int
    mode: str
    phase: str
    num_requests: int
    num_ok: int
    num_tokens: int
    wall_s: float
    gateway_cpu_us: float
    scheduler_cpu_us: float
    # Per request (classify) or per generated token (generate).
    gateway_cpu_us_per_unit: float
    scheduler_cpu_us_per_unit: float
    units_per_s: float
    # Failed generate streams by status code (a phase with failures measures less work than it claims).
    failures: dict[str, int] = field(default_factory=dict)


async def drive_generate(address: str, num_requests: int, concurrency: int, max_tokens: int,
                         max_tokens_per_chunk: int = 0) -> tuple[int, int, float]:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="toy-generator"), prompt="abc",
                                          sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
                                          stream=gateway_pb2.StreamOptions(max_tokens_per_chunk=max_tokens_per_chunk))
    remaining, num_ok, num_tokens = num_requests, 0, 0
    failures: Counter[str] = Counter()
    examples: dict[str, str] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)

        async def worker() -> None:
            nonlocal remaining, num_ok, num_tokens
            while remaining > 0:
                remaining -= 1
                try:
                    async for chunk in stub.Generate(request, timeout=60):
                        num_tokens += len(chunk.token_ids)
                    num_ok += 1
                except grpc.aio.AioRpcError as exc:
                    failures[exc.code().name] += 1
                    examples.setdefault(exc.code().name, exc.details())

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall_s = time.perf_counter() - began
        if failures:
            print(f"generate failures at {address}: {dict(failures)}; e.g. {examples}")
        LAST_FAILURES.clear()
        LAST_FAILURES.update(failures)
        return num_ok, num_tokens, wall_s


def measure(round_: int, mode: str, phase: str, pids: dict[str, int], idle: dict[str, float], run) -> Phase:
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    num_requests, num_ok, num_tokens, wall_s = run()
    cpu_us = {name: busy_cpu_s(pid, before[name], idle[name], wall_s) * 1e6 for name, pid in pids.items()}
    units = num_tokens if phase.startswith("generate") else num_ok
    return Phase(
        round=round_, mode=mode, phase=phase, num_requests=num_requests, num_ok=num_ok, num_tokens=num_tokens,
        wall_s=round(wall_s, 3), gateway_cpu_us=round(cpu_us["gateway"]), scheduler_cpu_us=round(cpu_us["scheduler"]),
        gateway_cpu_us_per_unit=round(cpu_us["gateway"] / max(1, units), 1),
        scheduler_cpu_us_per_unit=round(cpu_us["scheduler"] / max(1, units), 1),
        units_per_s=round(units / wall_s, 1),
        failures=dict(LAST_FAILURES) if phase.startswith("generate") else {},
    )


def run(num_classify: int, num_generate: int, max_tokens: int, concurrency: int, idle_s: float,
        num_rounds: int, coalesce_k: int = 8, with_classify: bool = True) -> dict:
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory(prefix="bench-upstream-") as tmp_dir, running_mesh(Path(tmp_dir), tls=False) as mesh:
        mesh.start_scheduler("--log-level", "WARNING")
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        gateways = {mode: spawn_gateway(mesh, f"gateway-{mode}", "--upstream-mode", mode, "--log-level", "WARNING")
                    for mode in MODES}
        for gateway in gateways.values():  # warm up channels, streams, caches, code paths
            asyncio.run(drive(gateway.address, "", 200, concurrency))
            asyncio.run(drive_generate(gateway.address, concurrency, concurrency, 8))
        for round_ in range(num_rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                gateway = gateways[mode]
                pids = {"gateway": gateway.proc.pid, "scheduler": mesh.scheduler.proc.pid}
                idle = idle_rates(pids, idle_s)

                def classify(address=gateway.address):
                    codes, wall_s = asyncio.run(drive(address, "", num_classify, concurrency))
                    return num_classify, codes.get("OK", 0), 0, wall_s

                def generate(address=gateway.address, k=0):
                    return num_generate, *asyncio.run(drive_generate(address, num_generate, concurrency, max_tokens, k))

                if with_classify:
                    phases.append(measure(round_, mode, "classify", pids, idle, classify))
                phases.append(measure(round_, mode, "generate", pids, idle, generate))
                if coalesce_k:
                    phases.append(measure(round_, mode, f"generate_k{coalesce_k}", pids, idle,
                                          lambda generate=generate: generate(k=coalesce_k)))
    return {
        "benchmark": "upstream",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"num_classify": num_classify, "num_generate": num_generate, "max_tokens": max_tokens,
                     "concurrency": concurrency, "num_rounds": num_rounds, "coalesce_k": coalesce_k},
        "phases": [asdict(p) for p in phases],
        "stream_over_unary": ratios(phases),
        "coalesced_over_plain": coalesced_ratios(phases, coalesce_k),
    }


def ratios(phases: list[Phase]) -> dict:
    """stream / unary of the medians over rounds, per phase and process."""
    def median(mode: str, phase: str, field: str) -> float:
        return statistics.median(getattr(p, field) for p in phases if (p.mode, p.phase) == (mode, phase))

    return {
        phase: {
            process: round(median("stream", phase, f"{process}_cpu_us_per_unit")
                           / max(median("unary", phase, f"{process}_cpu_us_per_unit"), 1e-9), 3)
            for process in ("gateway", "scheduler")
        }
        for phase in dict.fromkeys(p.phase for p in phases)
    }


def coalesced_ratios(phases: list[Phase], coalesce_k: int) -> dict:
    """generate_kK / generate of the medians over rounds (CPU per token), per mode and process."""
    if not coalesce_k:
        return {}

    def median(mode: str, phase: str, field: str) -> float:
        return statistics.median(getattr(p, field) for p in phases if (p.mode, p.phase) == (mode, phase))

    return {
        mode: {
            process: round(median(mode, f"generate_k{coalesce_k}", f"{process}_cpu_us_per_unit")
                           / max(median(mode, "generate", f"{process}_cpu_us_per_unit"), 1e-9), 3)
            for process in ("gateway", "scheduler")
        }
        for mode in MODES
    }


def print_table(results: dict) -> None:
    print(f"{'round':<5} {'mode':<7} {'phase':<11} {'requests':>8} {'ok':>6} {'tokens':>7} {'gateway us/unit':>15} "
          f"{'scheduler us/unit':>17} {'units/s':>9}")
    for p in results["phases"]:
        print(f"{p['round']:<5} {p['mode']:<7} {p['phase']:<11} {p['num_requests']:>8} {p['num_ok']:>6} {p['num_tokens']:>7} "
              f"{p['gateway_cpu_us_per_unit']:>15.1f} {p['scheduler_cpu_us_per_unit']:>17.1f} {p['units_per_s']:>9.1f}")
    print("unit: a classify request, or a generated token")
    for phase, ratio in results["stream_over_unary"].items():
        print(f"stream / unary (medians), {phase}: gateway CPU {ratio['gateway']}, scheduler CPU {ratio['scheduler']}")
    for mode, ratio in results["coalesced_over_plain"].items():
        print(f"coalesced / one token per chunk (medians), {mode}: gateway CPU {ratio['gateway']}, "
              f"scheduler CPU {ratio['scheduler']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-classify", type=int, default=3000)
    parser.add_argument("--num-generate", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="measurements per mode, in alternating order")
    parser.add_argument("--idle-s", type=float, default=2.0, help="how long each process's idle CPU rate is measured")
    parser.add_argument("--coalesce-k", type=int, default=8,
                        help="stream.max_tokens_per_chunk of the generate_kK phase (0: no such phase)")
    parser.add_argument("--no-classify", action="store_true", help="generate phases only")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH, help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    args = parser.parse_args()
    if args.quick:
        args.num_classify, args.num_generate = args.num_classify // 4, args.num_generate // 4
    results = run(args.num_classify, args.num_generate, args.max_tokens, args.concurrency, args.idle_s, args.rounds,
                  args.coalesce_k, not args.no_classify)
    print_table(results)
    write_report(args.out, results)


if __name__ == "__main__":
    main()
