"""How close the scheduler gets to its workers' step rate with hundreds of sequences, on mock workers.

    .venv/bin/python -m bench.scheduler.bench_mock_scale [--quick] [--step-ms 40]

Mock generator workers (services/worker/mock_models.py) answer each step after `--step-ms` on a
timer and cost almost no CPU, so what limits tokens/s here is the scheduler (and this client,
which shares the 2 cores). For each (workers, streams) case, a closed loop of Generate streams at
the scheduler's own RPC (64 tokens each, short prompts) runs for a window; every stream's text is
checked against the mock's tokens. Ideal tokens/s = running sequences x 1000 / step_ms (each
running sequence gains one token per step); efficiency = measured / ideal. Also each process's CPU
share of one core over the window.

Prints a table and writes bench/results/mock_scale.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc

from bench.harness.cpu import cpu_seconds
from bench.harness.results import RESULTS_DIR, ROOT, write_report
from infermesh.v1 import scheduler_pb2_grpc
from tools.testbed.generator_models import MOCK, mock_text
from tools.testbed.processes import running_mesh

RESULTS_PATH = RESULTS_DIR / "mock_scale.json"
MAX_TOKENS = 64
MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class Case:
    num_workers: int
    num_streams: int
    step_ms: float
    tokens_per_s: float
    ideal_tokens_per_s: float
    efficiency: float
    num_completed: int
    num_wrong: int
    scheduler_cpu: float  # fraction of one core over the window
    workers_cpu: float  # all workers together
    client_cpu: float


async def _client(address: str, num_streams: int, warmup_s: float, window_s: float, pids: list[int]):
    """(tokens, completed, wrong) in the window, its length, and each pid's CPU seconds in it."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        tokens, completed, wrong = [0], [0], [0]
        measuring = [False]

        async def loop(i: int, stop_at: float) -> None:
            prompt = f"stream {i} of the mock "
            expected = mock_text(prompt, MAX_TOKENS)
            while time.perf_counter() < stop_at:
                text = []
                async for response in stub.Generate(MOCK.request(prompt, MAX_TOKENS), timeout=120):
                    text.append(response.chunk.text)
                    if measuring[0]:
                        tokens[0] += len(response.chunk.token_ids)
                if measuring[0]:
                    completed[0] += 1
                    wrong[0] += "".join(text) != expected

        began = time.perf_counter()
        stop_at = began + warmup_s + window_s
        tasks = [asyncio.create_task(loop(i, stop_at)) for i in range(num_streams)]
        await asyncio.sleep(warmup_s)
        cpu_before = [cpu_seconds(pid) for pid in pids]
        measuring[0] = True
        measured_from = time.perf_counter()
        await asyncio.sleep(window_s)
        measuring[0] = False
        measured_s = time.perf_counter() - measured_from
        cpu_used = [cpu_seconds(pid) - before for pid, before in zip(pids, cpu_before, strict=True)]
        snapshot = tokens[0], completed[0], wrong[0]
        await asyncio.gather(*tasks)
        return snapshot, measured_s, cpu_used


def measure(num_workers: int, num_streams: int, args, tmp: Path) -> Case:
    profile = f"step_ms={args.step_ms:g},max_num_seqs={MAX_NUM_SEQS},max_num_batched_tokens=4096"
    with running_mesh(tmp, tls=False) as mesh:
        scheduler = mesh.start_scheduler()
        workers = [mesh.start_worker(MOCK.name, "--mock-profile", profile, name=f"mock-{num_workers}-{i}")
                   for i in range(num_workers)]
        pids = [scheduler.proc.pid, *(w.proc.pid for w in workers), os.getpid()]
        (num_tokens, num_completed, num_wrong), window_s, cpu_s = asyncio.run(
            _client(scheduler.address, num_streams, args.warmup_s, args.window_s, pids))
    running = min(num_streams, num_workers * MAX_NUM_SEQS)
    ideal = running * 1000 / args.step_ms
    tokens_per_s = num_tokens / window_s
    return Case(num_workers, num_streams, args.step_ms, round(tokens_per_s, 1), round(ideal, 1),
                round(tokens_per_s / ideal, 3), num_completed, num_wrong, round(cpu_s[0] / window_s, 3),
                round(sum(cpu_s[1:-1]) / window_s, 3), round(cpu_s[-1] / window_s, 3))


CASES = "1x32,1x128,2x256,4x512"  # workers x streams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 s windows")
    parser.add_argument("--step-ms", type=float, default=40.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--cases", default=CASES, help=f"workers x streams, comma-separated (default {CASES})")
    args = parser.parse_args()
    if args.quick:
        args.window_s = 5.0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for num_workers, num_streams in (map(int, c.split("x")) for c in args.cases.split(",")):
            case = measure(num_workers, num_streams, args, Path(tmp))
            results.append(case)
            print(case, flush=True)
    print(f"\nmock generator workers, {args.step_ms:g} ms per step, {MAX_TOKENS}-token streams at the scheduler, "
          f"{args.window_s:g} s windows, {os.cpu_count()} cores shared with the client")
    print(f"{'workers':>7} {'streams':>7} {'tokens/s':>9} {'ideal':>8} {'effic.':>7} {'wrong':>5} "
          f"{'sched cpu':>9} {'workers cpu':>11} {'client cpu':>10}")
    for c in results:
        print(f"{c.num_workers:>7} {c.num_streams:>7} {c.tokens_per_s:>9.0f} {c.ideal_tokens_per_s:>8.0f} "
              f"{c.efficiency:>7.2f} {c.num_wrong:>5} {c.scheduler_cpu:>9.2f} {c.workers_cpu:>11.2f} "
              f"{c.client_cpu:>10.2f}")
    write_report(RESULTS_PATH, {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {"step_ms": args.step_ms, "max_tokens": MAX_TOKENS, "window_s": args.window_s,
                     "warmup_s": args.warmup_s, "max_num_seqs": MAX_NUM_SEQS},
        "cases": [asdict(c) for c in results],
    })
    print(f"wrote {RESULTS_PATH.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
