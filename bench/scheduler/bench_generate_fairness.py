"""Generate fairness inside one priority class, against real processes on 127.0.0.1
(scheduler + one tinylm worker, called at the scheduler's own Generate RPC, no gateway).

    .venv/bin/python -m bench.scheduler.bench_generate_fairness [--quick] [--runs N] [--classes same|critical]
        [--scheduler-arg=--flag=value ...]

1. Capacity: streams/s the worker sustains for this request mix (closed loop, 3x max_num_seqs
   clients; output tokens/s over the window divided by the mean output length).
2. Per run: a light tenant at 3 streams/s (Poisson) alone, then the same light load while a
   heavy tenant of the same class and weight offers 2x capacity (Poisson, from a second client
   process so the light client's event loop measures only its own streams). Greedy, ignore EOS,
   prompts 8-48 bytes, max_tokens uniform in [8, 128]. Heavy calls carry a 5 s deadline, so its
   backlog is bounded by expiry rather than by the queue's hard cap.

Reports the light tenant's TTFT p99 alone vs flooded (target: <= 3x), its end-to-end p99, the
heavy tenant's goodput, and the scheduler's preemptions during the flood; per run also the TTFT
and queue wait the scheduler itself measured (from the last chunk), the load average and the
cores each process used, since on a shared machine a starved worker or scheduler shows up there
and not in the scheduling policy. `--classes critical` makes the light tenant critical and the
flood sheddable. Medians over runs in the table; every run's figures (and every light TTFT) in
bench/results/generate_fairness.json. bench/scheduler/bench_sim_generate_fairness.py runs the same scenario on a
fake clock.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import uvloop

from bench.harness.results import RESULTS_DIR, ROOT, write_report
from bench.harness.stats import quantile
from bench.scheduler.cluster import (
    Cluster,
    cluster,
    declared_max_num_seqs,
    generate_request,
    prompt_text,
    repository_model,
    with_channel,
)
from bench.scheduler.cluster import stream as bench_stream
from bench.scheduler.table import print_table, progress
from infermesh.v1 import common_pb2, scheduler_pb2_grpc

RESULTS_PATH = RESULTS_DIR / "generate_fairness.json"
MODEL = "tinylm"
LIGHT_PER_S = 3.0
HEAVY_CAPACITY_MULTIPLE = 2.0
MIN_PROMPT_BYTES, MAX_PROMPT_BYTES = 8, 48
MIN_TOKENS, MAX_TOKENS = 8, 128
HEAVY_TIMEOUT_S = 5.0
LIGHT_TIMEOUT_S = 60.0
TARGET_RATIO = 3.0


@dataclass(frozen=True)
class Profile:
    runs: int
    capacity_s: float
    warmup_s: float  # the flood fills the running set and the queue before light streams count
    window_s: float  # light streams sent in this window are measured


FULL = Profile(runs=3, capacity_s=8.0, warmup_s=3.0, window_s=30.0)
QUICK = Profile(runs=1, capacity_s=4.0, warmup_s=2.0, window_s=12.0)


# Priority classes of the light and the heavy tenant: "same" is the case; "critical" puts a
# critical light tenant against a sheddable flood.
CLASSES = {"same": (common_pb2.PRIORITY_STANDARD, common_pb2.PRIORITY_STANDARD),
           "critical": (common_pb2.PRIORITY_CRITICAL, common_pb2.PRIORITY_SHEDDABLE)}


def _request(rng: random.Random, who: str, priority: int = common_pb2.PRIORITY_STANDARD):
    prompt = prompt_text(rng, rng.randint(MIN_PROMPT_BYTES, MAX_PROMPT_BYTES))
    request = generate_request(MODEL, prompt, rng.randint(MIN_TOKENS, MAX_TOKENS), who)
    request.tenant.priority = priority
    return request


@dataclass
class LightStream:
    ttft_s: float = math.nan
    done_s: float = math.nan
    num_tokens: int = 0
    code: str = "OK"
    # From the scheduler's last chunk: its own TTFT (from the call's arrival there) and queue wait.
    scheduler_ttft_s: float = math.nan
    queue_wait_s: float = math.nan


async def stream(stub, request, began_s: float, timeout_s: float) -> LightStream:
    result = LightStream()
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            chunk = response.chunk
            if chunk.token_ids and result.num_tokens == 0:
                result.ttft_s = time.perf_counter() - began_s
            result.num_tokens += len(chunk.token_ids)
            if chunk.finish_reason:
                result.scheduler_ttft_s = chunk.ttft_us / 1e6
                result.queue_wait_s = sum(s.duration_us for s in chunk.timings.stages
                                          if s.stage == common_pb2.STAGE_QUEUE_WAIT) / 1e6
    except grpc.aio.AioRpcError as exc:
        result.code = exc.code().name
    result.done_s = time.perf_counter() - began_s
    return result


async def _open_loop_streams(stub, who: str, priority: int, rate_per_s: float, seed: int, send_for_s: float,
                             timeout_s: float, measured_from_s: float = 0.0, stop: asyncio.Event | None = None) -> list:
    """Poisson arrivals for `send_for_s`; (sent offset, StreamResult) per stream sent at or after
    `measured_from_s`. With `stop`: sending ends when it is set, and calls still running are cancelled."""
    rng = random.Random(seed)
    start_s = time.perf_counter()
    next_s = start_s
    calls = []
    while next_s < start_s + send_for_s and not (stop is not None and stop.is_set()):
        delay_s = next_s - time.perf_counter()
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        # Latency counts from the scheduled send time (open loop: no coordinated omission).
        calls.append((next_s - start_s, asyncio.ensure_future(
            stream(stub, _request(rng, who, priority), next_s, timeout_s))))
        next_s += rng.expovariate(rate_per_s)
    if stop is not None:
        await stop.wait()
        for _, task in calls:
            task.cancel()
    results = await asyncio.gather(*(task for _, task in calls), return_exceptions=True)
    return [(sent, r) for (sent, _), r in zip(calls, results, strict=True)
            if sent >= measured_from_s and not isinstance(r, BaseException)]


def _heavy_process(address: str, priority: int, rate_per_s: float, seed: int, send_for_s: float, stop, out) -> None:
    """The flood, in its own process: sends until `send_for_s`, cancels what is left once `stop` is set."""

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            done = asyncio.Event()

            async def watch_stop():
                while not stop.is_set():
                    await asyncio.sleep(0.05)
                done.set()

            watcher = asyncio.ensure_future(watch_stop())
            results = await _open_loop_streams(scheduler_pb2_grpc.SchedulerStub(channel), "heavy", priority,
                                               rate_per_s, seed, send_for_s, HEAVY_TIMEOUT_S, stop=done)
            await watcher
            return results

    results = uvloop.run(main())
    out.put({"sent": len(results),
             "ok": sum(1 for _, r in results if r.code == "OK"),
             "ok_tokens": sum(r.num_tokens for _, r in results if r.code == "OK"),
             "codes": {code: sum(1 for _, r in results if r.code == code) for code in {r.code for _, r in results}}})


def _light_summary(results: list) -> dict:
    ok = [r for _, r in results if r.code == "OK"]
    return {"streams": len(results), "errors": len(results) - len(ok),
            "ttft_p50_ms": 1000 * quantile([r.ttft_s for r in ok], 0.50),
            "ttft_p99_ms": 1000 * quantile([r.ttft_s for r in ok], 0.99),
            "e2e_p50_ms": 1000 * quantile([r.done_s for r in ok], 0.50),
            "e2e_p99_ms": 1000 * quantile([r.done_s for r in ok], 0.99),
            "scheduler_ttft_p99_ms": 1000 * quantile([r.scheduler_ttft_s for r in ok], 0.99),
            "queue_wait_p99_ms": 1000 * quantile([r.queue_wait_s for r in ok], 0.99),
            "ttft_ms": sorted(round(1000 * r.ttft_s, 1) for r in ok)}


def _preemptions(target: Cluster) -> float:
    return sum(v for (name, _), v in target.metrics().items() if name == "infermesh_scheduler_preemptions_total")


def measure_light(target: Cluster, profile: Profile, seed: int, heavy_per_s: float | None, classes: str) -> dict:
    """The light tenant's streams (sent after warm-up), alone or under a same-class flood."""
    ctx = multiprocessing.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    heavy = None
    light_priority, heavy_priority = CLASSES[classes]
    preempted_before = _preemptions(target)
    cpu_before_s, began_s = target.cpu_seconds(), time.perf_counter()
    if heavy_per_s is not None:
        heavy = ctx.Process(target=_heavy_process, args=(
            target.address, heavy_priority, heavy_per_s, seed + 1000, profile.warmup_s + profile.window_s + 60.0, stop, out))
        heavy.start()

    async def light(t: Cluster):
        return await _open_loop_streams(t.stub, "light", light_priority, LIGHT_PER_S, seed, profile.warmup_s + profile.window_s,
                                        LIGHT_TIMEOUT_S, measured_from_s=profile.warmup_s)

    summary = _light_summary(with_channel(target, light))
    summary["preemptions"] = _preemptions(target) - preempted_before
    # The machine is shared: a high load average marks a phase whose latencies are not the scheduler's alone.
    summary["load_average_1m"] = os.getloadavg()[0]
    elapsed_s = time.perf_counter() - began_s
    summary["cpu_cores"] = {name: round((used - cpu_before_s[name]) / elapsed_s, 2)
                            for name, used in target.cpu_seconds().items()}
    if heavy is not None:
        stop.set()
        summary["heavy"] = out.get(timeout=60)
        heavy.join(timeout=30)
    time.sleep(1.0)  # cancelled flood streams are aborted and their blocks freed before the next phase
    return summary


def measure_capacity(target: Cluster, profile: Profile) -> dict:
    mean_tokens = (MIN_TOKENS + MAX_TOKENS) / 2
    concurrency = 3 * declared_max_num_seqs(MODEL)

    async def saturate(t: Cluster) -> float:
        rng = random.Random(7)
        window_from_s = time.perf_counter() + 1.5
        window_to_s = window_from_s + profile.capacity_s
        token_times: list[float] = []

        async def client() -> None:
            while time.perf_counter() < window_to_s:
                result = await bench_stream(t.stub, _request(rng, "capacity"), time.perf_counter(), keep_times=True)
                token_times.extend(result.token_times_s)

        tasks = [asyncio.ensure_future(client()) for _ in range(concurrency)]
        await asyncio.sleep(window_to_s - time.perf_counter())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.5)
        return sum(window_from_s <= s < window_to_s for s in token_times) / profile.capacity_s

    tokens_per_s = with_channel(target, saturate)
    return {"tokens_per_s": tokens_per_s, "streams_per_s": tokens_per_s / mean_tokens}


def run(profile: Profile, scheduler_args: list[str], classes: str) -> dict:
    if not repository_model(MODEL):
        raise SystemExit(f"{MODEL} is not built: run `make models` first")
    runs = []
    with cluster(scheduler_args, [(MODEL, ["--model-repository", str(ROOT / "model_repo")])]) as target:
        capacity = measure_capacity(target, profile)
        heavy_per_s = HEAVY_CAPACITY_MULTIPLE * capacity["streams_per_s"]
        progress(f"capacity {capacity['streams_per_s']:.1f} streams/s ({capacity['tokens_per_s']:.0f} tokens/s); "
                  f"heavy offers {heavy_per_s:.1f}/s")
        for index in range(profile.runs):
            alone = measure_light(target, profile, seed=index, heavy_per_s=None, classes=classes)
            flooded = measure_light(target, profile, seed=index, heavy_per_s=heavy_per_s, classes=classes)
            result = {"alone": alone, "flooded": flooded,
                      "ttft_ratio": flooded["ttft_p99_ms"] / alone["ttft_p99_ms"],
                      "e2e_ratio": flooded["e2e_p99_ms"] / alone["e2e_p99_ms"]}
            runs.append(result)
            progress(f"run {index + 1}: light TTFT p99 {alone['ttft_p99_ms']:.0f} -> {flooded['ttft_p99_ms']:.0f} ms "
                      f"({result['ttft_ratio']:.2f}x; at the scheduler {alone['scheduler_ttft_p99_ms']:.0f} -> "
                      f"{flooded['scheduler_ttft_p99_ms']:.0f} ms, queue wait p99 {alone['queue_wait_p99_ms']:.0f} -> "
                      f"{flooded['queue_wait_p99_ms']:.0f} ms), e2e p99 {alone['e2e_p99_ms']:.0f} -> "
                      f"{flooded['e2e_p99_ms']:.0f} ms, heavy ok {flooded['heavy']['ok']}/{flooded['heavy']['sent']}, "
                      f"preemptions {flooded['preemptions']:.0f}, load average {alone['load_average_1m']:.1f} / "
                      f"{flooded['load_average_1m']:.1f}, cores used under flood {flooded['cpu_cores']}")

    def median(*path: str) -> float:
        values = []
        for r in runs:
            value = r
            for key in path:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    window_s = profile.window_s + profile.warmup_s
    return {"classes": classes, "capacity": capacity, "heavy_per_s": heavy_per_s, "light_per_s": LIGHT_PER_S, "runs": runs,
            "ttft_ratio": median("ttft_ratio"), "e2e_ratio": median("e2e_ratio"),
            "alone_ttft_p99_ms": median("alone", "ttft_p99_ms"), "flooded_ttft_p99_ms": median("flooded", "ttft_p99_ms"),
            "alone_e2e_p99_ms": median("alone", "e2e_p99_ms"), "flooded_e2e_p99_ms": median("flooded", "e2e_p99_ms"),
            "heavy_ok_per_s": statistics.median(r["flooded"]["heavy"]["ok"] / window_s for r in runs),
            "preemptions": median("flooded", "preemptions")}


def table_rows(r: dict) -> list[tuple[str, str, str, str, str]]:
    met = "yes" if r["ttft_ratio"] <= TARGET_RATIO else "NO"
    who = "same-class heavy" if r["classes"] == "same" else "critical light, sheddable heavy"
    return [
        (f"light TTFT p99 (3/s), {who} at {HEAVY_CAPACITY_MULTIPLE:.0f}x capacity vs alone",
         f"{r['flooded_ttft_p99_ms']:.0f} vs {r['alone_ttft_p99_ms']:.0f} ms", f"{r['ttft_ratio']:.2f}x",
         f"<= {TARGET_RATIO:.0f}x", met),
        ("  same runs: light e2e p99", f"{r['flooded_e2e_p99_ms']:.0f} vs {r['alone_e2e_p99_ms']:.0f} ms",
         f"{r['e2e_ratio']:.2f}x", "-", "(info)"),
        ("  same runs: heavy completed streams/s, preemptions per run",
         f"{r['heavy_ok_per_s']:.1f}/s of {r['heavy_per_s']:.1f}/s offered "
         f"(capacity {r['capacity']['streams_per_s']:.1f}/s); {r['preemptions']:.0f}", "-", "-", "(info)"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run (about a minute)")
    parser.add_argument("--runs", type=int, default=None, help="runs (median reported)")
    parser.add_argument("--scheduler-arg", action="append", default=[],
                        help="extra scheduler flag, e.g. --scheduler-arg=--max-num-seqs=16 (repeatable)")
    parser.add_argument("--classes", choices=sorted(CLASSES), default="same",
                        help="priority classes of the light and heavy tenants (critical: critical vs sheddable)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    profile = QUICK if args.quick else FULL
    if args.runs:
        profile = Profile(**{**asdict(profile), "runs": args.runs})
    began = time.monotonic()
    scheduler_args = [part for arg in args.scheduler_arg for part in arg.split("=", 1)]
    result = run(profile, scheduler_args, args.classes)
    rows = table_rows(result)
    print()
    print_table(rows)
    print(f"\n{profile.runs} run(s), median shown; {time.monotonic() - began:.0f} s in all")
    report = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                          "load_average_1m": os.getloadavg()[0], "python": platform.python_version()},
              "profile": asdict(profile), "scheduler_args": scheduler_args, "quick": args.quick,
              "table": [dict(zip(("benchmark", "measured", "ratio", "target", "met"), row, strict=True))
                        for row in rows],
              "results": result}
    write_report(args.output, report)


if __name__ == "__main__":
    main()
