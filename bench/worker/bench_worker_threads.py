"""Generation with the worker's threads sized to the machine vs to its share of it, `make up`-like.

    .venv/bin/python -m bench.worker.bench_worker_threads [--quick] [--runs N] [--threads 2 1]

Starts what `make up` starts (scheduler, gateway, a digits worker and a tinylm worker, each a
process on 127.0.0.1) once per thread count, then drives tinylm through the gateway: a closed loop
of `--streams` Generate clients (short prompts, 64 tokens each) plus a light classify load on
digits, so the generator worker shares the cores with the scheduler, gateway, classifier and this
client, as in the demo. Each run measures every thread count in turn (alternating which goes first),
so each ratio comes from one run. Reports output tokens/s and stream e2e p50/p99 and TTFT p50.

The worker env carries no OMP_NUM_THREADS, so `--num-threads N` alone sizes the pools (N = the core
count is what a worker took before it read its CPU allocation).

Prints a table and writes bench/results/worker_threads.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.harness.results import RESULTS_DIR, ROOT, write_report
from bench.harness.stats import quantile
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.worker.thread_settings import THREAD_ENV_VARS
from tools.testbed.processes import running_mesh

RESULTS_PATH = RESULTS_DIR / "worker_threads.json"
TENANTS = ROOT / "deploy" / "local" / "tenants.yaml"
AUTH = (("authorization", "Bearer demo-key-alpha"),)
PROMPTS = ("The value of ", "A list is ", "Every function ", "The module ", "An exception ", "To read a file ")
MAX_TOKENS = 64
DIGIT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(range(64)), height=8, width=8, channels=1))


@dataclass(frozen=True)
class Figures:
    num_threads: int
    tokens_per_s: float
    num_streams: int
    e2e_p50_ms: float
    e2e_p99_ms: float
    ttft_p50_ms: float
    num_classify: int


async def _stream(stub, prompt: str, stop_at: float, e2e_s: list[float], ttft_s: list[float],
                  tokens: list[int]) -> None:
    while time.perf_counter() < stop_at:
        began = time.perf_counter()
        first, num_tokens = None, 0
        request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="tinylm"), prompt=prompt,
                                              sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
        async for response in stub.Generate(request, timeout=60, metadata=AUTH):
            if response.token_ids and first is None:
                first = time.perf_counter()
            num_tokens += len(response.token_ids)
        ended = time.perf_counter()
        if ended <= stop_at:  # only streams that finished inside the window count
            e2e_s.append(ended - began)
            ttft_s.append((first or ended) - began)
            tokens.append(num_tokens)


async def _classify(stub, stop_at: float, rate_per_s: float, done: list[int]) -> None:
    while time.perf_counter() < stop_at:
        await stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="digits"), image=DIGIT),
                            timeout=10, metadata=AUTH)
        done.append(1)
        await asyncio.sleep(1 / rate_per_s)


async def _drive(address: str, num_streams: int, warmup_s: float, window_s: float) -> tuple:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        warm_until = time.perf_counter() + warmup_s
        await asyncio.gather(*(_stream(stub, PROMPTS[i % len(PROMPTS)], warm_until, [], [], [])
                               for i in range(num_streams)))
        e2e_s, ttft_s, tokens, classified = [], [], [], []
        began = time.perf_counter()
        stop_at = began + window_s
        await asyncio.gather(
            *(_stream(stub, PROMPTS[i % len(PROMPTS)], stop_at, e2e_s, ttft_s, tokens) for i in range(num_streams)),
            _classify(stub, stop_at, 20.0, classified),
        )
        return e2e_s, ttft_s, sum(tokens) / (time.perf_counter() - began), len(classified)


def measure(num_threads: int, args, tmp: Path) -> Figures:
    env = {name: "" for name in THREAD_ENV_VARS}  # the flag alone decides (an empty variable is unset)
    with running_mesh(tmp, env=env, tls=False) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("digits", "--num-threads", str(num_threads), name=f"digits-{num_threads}")
        mesh.start_worker("tinylm", "--num-threads", str(num_threads), name=f"tinylm-{num_threads}")
        mesh.start_gateway("--tenants-file", str(TENANTS))
        e2e_s, ttft_s, tokens_per_s, num_classify = asyncio.run(
            _drive(mesh.gateway.address, args.streams, args.warmup_s, args.window_s))
    return Figures(num_threads, round(tokens_per_s, 1), len(e2e_s), round(quantile(e2e_s, 0.5) * 1e3, 1),
                   round(quantile(e2e_s, 0.99) * 1e3, 1), round(quantile(ttft_s, 0.5) * 1e3, 1), num_classify)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one run, 8 s windows")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 2, 1],
                        help="thread counts to compare; the first is the baseline")
    parser.add_argument("--streams", type=int, default=8, help="concurrent Generate clients")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    args = parser.parse_args()
    if args.quick:
        args.runs, args.window_s = 1, 8.0
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            order = args.threads if run % 2 == 0 else list(reversed(args.threads))
            figures = {f.num_threads: f for f in (measure(n, args, Path(tmp)) for n in order)}
            runs.append([figures[n] for n in args.threads])
            for f in runs[-1]:
                print(f"run {run + 1}: {f}", flush=True)
    baseline = args.threads[0]
    print(f"\ntinylm through the gateway, {args.streams} streams x {MAX_TOKENS} tokens, {args.window_s:g} s windows, "
          f"{os.cpu_count()} cores, median of {args.runs} run(s)")
    print(f"{'threads/worker':>14} {'tokens/s':>9} {'e2e p50 ms':>11} {'e2e p99 ms':>11} {'ttft p50 ms':>12} "
          f"{'tok/s vs ' + str(baseline):>13}")
    table = []
    for i, n in enumerate(args.threads):
        column = [r[i] for r in runs]
        ratios = [r[i].tokens_per_s / r[0].tokens_per_s for r in runs]
        row = {"num_threads": n, "tokens_per_s": statistics.median(f.tokens_per_s for f in column),
               "e2e_p50_ms": statistics.median(f.e2e_p50_ms for f in column),
               "e2e_p99_ms": statistics.median(f.e2e_p99_ms for f in column),
               "ttft_p50_ms": statistics.median(f.ttft_p50_ms for f in column),
               "tokens_per_s_ratio": round(statistics.median(ratios), 3), "ratios": [round(r, 3) for r in ratios]}
        table.append(row)
        print(f"{n:>14} {row['tokens_per_s']:>9.1f} {row['e2e_p50_ms']:>11.1f} {row['e2e_p99_ms']:>11.1f} "
              f"{row['ttft_p50_ms']:>12.1f} {row['tokens_per_s_ratio']:>12.2f}x")
    write_report(RESULTS_PATH, {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {"streams": args.streams, "max_tokens": MAX_TOKENS, "window_s": args.window_s,
                     "warmup_s": args.warmup_s, "runs": args.runs},
        "table": table, "runs": [[asdict(f) for f in r] for r in runs],
    })
    print(f"wrote {RESULTS_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
