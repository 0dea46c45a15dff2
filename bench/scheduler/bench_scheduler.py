"""Scheduler benchmarks against real processes on 127.0.0.1 (scheduler + workers, called at the
scheduler's own RPCs with a TenantContext, no gateway).

    .venv/bin/python -m bench.scheduler.bench_scheduler [--quick] [--runs N] [--only NAME ...]

Each run measures both sides of every comparison, so each ratio comes from one run; the
table shows the median over runs (and every run's ratio in the JSON). Scenarios:

  batching     max classify throughput with p99 <= 100 ms (and <= 1% errors), dynamic batching
               vs --max-batch-size 1; open-loop Poisson arrivals, rate searched by growth then
               bisection. Model: digits from model_repo (else the toy classifier, constant 5 ms
               per batch - a sublinear batch cost - and the table says so).
  continuous   output tokens/s on tinylm (else the toy generator) with the running set kept full
               (closed loop, 3x max_num_seqs clients) and output lengths drawn log-uniformly from
               [4, 240]: continuous batching vs static batching (bench/scheduler/static_batching.py: a new batch only once the whole
               running set finished; finished members stay in the batch as padding, as in a
               fixed-shape batch) and, as an info row, vs static batching whose finished members
               drop out of the steps. With tinylm, also the toy generator (a step cost that does
               not grow with the batch, like a memory-bound GPU decode) as a reference row.
  chunked      TTFT p99 under Poisson arrivals (20/s), 20% long prompts (800-1000 tokens) and 80%
               short (8-20): chunked prefill (128-token chunks, a 256-token step budget) vs
               none (whole prompts, a 1024-token budget); TTFT of short prompts and
               of all requests, and the short requests' inter-token p99 (decode stalls).
  overhead     scheduler<->worker overhead per decode step at 32 running sequences: the toy
               generator with a fixed 20 ms step (a small model's GPU decode step), the
               clients' median gap between tokens minus the worker's own time per step; the
               scheduler's step metrics split it into scheduling and transport.
  fairness     light tenant's p99 (half its fair share) alone vs while a heavy tenant offers 5x
               its share; toy classifier at 20 ms per batch of 8, so the load is the model's and
               not this 2-core machine's CPU. Also the light p99 if both shared one queue.

Prints a table and writes bench/results/scheduler.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc

from bench.harness.results import MODEL_REPO, RESULTS_DIR, write_report
from bench.harness.stats import quantile
from bench.scheduler.cluster import (
    Cluster,
    StreamResult,
    cluster,
    declared_max_num_seqs,
    generate_request,
    prompt_text,
    repository_model,
    stream,
    tenant,
    with_channel,
)
from bench.scheduler.table import print_table, progress
from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2

RESULTS_PATH = RESULTS_DIR / "scheduler.json"
# The scheduler with static batching, the continuous scenario's baseline (the same flags otherwise).
STATIC_BATCHING = "bench.scheduler.static_batching"
SLO_P99_S = 0.100
MAX_ERROR_RATIO = 0.01
TARGETS = {
    "batching": ">= 4x",
    "continuous": ">= 3x",
    "chunked": "<= 0.5x",
    "overhead": "<= 10%",
    "fairness": "<= 1.5x",
}


@dataclass(frozen=True)
class Profile:
    runs: int
    probe_s: float  # measured part of one throughput probe
    warmup_s: float
    num_bisections: int
    fairness_s: float
    continuous_warmup_s: float
    continuous_s: float
    chunked_s: float
    chunked_rate_per_s: float
    overhead_tokens: int
    # Also run continuous vs static on the toy generator (needs a long window: one static batch of 32
    # takes about 3 s at 10 ms a step).
    constant_step_reference: bool


FULL = Profile(runs=3, probe_s=2.0, warmup_s=0.4, num_bisections=3, fairness_s=4.0, continuous_warmup_s=1.5,
               continuous_s=8.0, chunked_s=20.0, chunked_rate_per_s=20.0, overhead_tokens=160,
               constant_step_reference=True)
QUICK = Profile(runs=1, probe_s=1.0, warmup_s=0.25, num_bisections=2, fairness_s=2.5, continuous_warmup_s=1.0,
                continuous_s=4.0, chunked_s=4.0, chunked_rate_per_s=20.0, overhead_tokens=100,
                constant_step_reference=False)


# -- load ------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    latency_s: float  # from the scheduled send time (open loop: no coordinated omission)
    code: str
    # From the scheduled send time to the send's start: the load generator's own lag (a run where it fell
    # behind measures the generator, not the scheduler).
    lag_s: float = 0.0


async def _timed(send: Callable[[], Awaitable[object]], scheduled_s: float) -> Outcome:
    started_s = time.perf_counter()
    try:
        await send()
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    return Outcome(time.perf_counter() - scheduled_s, code, started_s - scheduled_s)


async def open_loop(send: Callable[[], Awaitable[object]], rate_per_s: float, duration_s: float, warmup_s: float,
                    rng: random.Random) -> list[Outcome]:
    """Poisson arrivals at `rate_per_s` for warmup + duration; outcomes of those sent after warm-up."""
    start_s = time.perf_counter()
    end_s = start_s + warmup_s + duration_s
    measured_from_s = start_s + warmup_s
    next_s = start_s
    calls: list[tuple[float, asyncio.Task]] = []
    while next_s < end_s:
        now_s = time.perf_counter()
        if next_s > now_s:
            await asyncio.sleep(next_s - now_s)
            now_s = time.perf_counter()
        while next_s <= now_s and next_s < end_s:
            calls.append((next_s, asyncio.ensure_future(_timed(send, next_s))))
            next_s += rng.expovariate(rate_per_s)
    outcomes = await asyncio.gather(*(task for _, task in calls))
    return [o for (sent_s, _), o in zip(calls, outcomes, strict=True) if sent_s >= measured_from_s]


# -- batching --------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    offered_per_s: float
    throughput_per_s: float
    p99_ms: float
    error_ratio: float
    # CPU used by each process during the probe, in cores (the machine has os.cpu_count()).
    cpu_cores: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.p99_ms <= SLO_P99_S * 1000 and self.error_ratio <= MAX_ERROR_RATIO


def _digits_image() -> common_pb2.Image:
    manifest = json.loads((MODEL_REPO / "digits" / "1" / "manifest.json").read_text())
    golden = manifest["classifier"]["golden"][0]
    return common_pb2.Image(raw=common_pb2.RawImage(
        pixels=base64.b64decode(golden["pixels_b64"]), height=golden["height"], width=golden["width"],
        channels=golden["channels"]))


def classify_sender(stub, model: str, image: common_pb2.Image, who: str, timeout_s: float):
    request = scheduler_pb2.ScheduleClassifyRequest(
        request=gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=model), image=image), tenant=tenant(who))

    def send():
        return stub.Classify(request, timeout=timeout_s)

    return send


async def probe(target: Cluster, send, rate_per_s: float, profile: Profile, rng: random.Random) -> Probe:
    cpu_before, began = target.cpu_seconds(), time.perf_counter()
    outcomes = await open_loop(send, rate_per_s, profile.probe_s, profile.warmup_s, rng)
    cpu_after, elapsed_s = target.cpu_seconds(), time.perf_counter() - began
    ok = [o.latency_s for o in outcomes if o.code == "OK"]
    latencies = ok + [math.inf] * (len(outcomes) - len(ok))
    await asyncio.sleep(0.2)  # let a failed probe's backlog drain before the next
    return Probe(rate_per_s, len(ok) / profile.probe_s, 1000 * quantile(latencies, 0.99),
                 1 - len(ok) / max(1, len(outcomes)),
                 {name: round((cpu_after[name] - cpu_before[name]) / elapsed_s, 2) for name in cpu_after})


async def max_rate_at_slo(target: Cluster, send, start_per_s: float, profile: Profile,
                          rng: random.Random) -> tuple[Probe, list[Probe]]:
    """Grows the offered rate by 1.5x until the SLO breaks, then bisects between the last pass and fail."""
    probes = []
    rate = start_per_s
    best: Probe | None = None
    while True:
        result = await probe(target, send, rate, profile, rng)
        probes.append(result)
        if not result.passed:
            break
        best = result
        rate *= 1.5
    if best is None:  # even the starting rate failed: come down
        while best is None and rate > 5:
            rate /= 2
            result = await probe(target, send, rate, profile, rng)
            probes.append(result)
            best = result if result.passed else None
        if best is None:
            return probes[-1], probes
    low, high = best.offered_per_s, rate
    for _ in range(profile.num_bisections):
        mid = (low + high) / 2
        result = await probe(target, send, mid, profile, rng)
        probes.append(result)
        if result.passed:
            best, low = result, mid
        else:
            high = mid
    return best, probes


def bench_batching(profile: Profile) -> dict:
    real = repository_model("digits")
    if real:
        model, image, worker_args = "digits", _digits_image(), ["--model-repository", str(MODEL_REPO)]
        note = "digits CNN (model_repo/digits/1), raw 32x32x3 images"
    else:
        model = "toy-classifier"
        image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3))
        worker_args = ["--toy-compute-ms", "5", "--max-batch-size", "64"]
        note = "toy classifier, constant 5 ms per batch (sublinear batch cost): digits not built"
    runs = []
    with (cluster([], [(model, worker_args)]) as batched,
          cluster(["--max-batch-size", "1"], [(model, worker_args)]) as single):
        start = {"batched": 200.0, "single": 100.0}
        for run in range(profile.runs):
            rng = random.Random(run)
            result = {}
            for name, target in (("batched", batched), ("single", single)):
                best, probes = with_channel(target, lambda t, n=name, r=rng: max_rate_at_slo(
                    t, classify_sender(t.stub, model, image, "bench", 1.0), start[n], profile, r))
                start[name] = max(20.0, 0.6 * best.offered_per_s)
                result[name] = {"best": asdict(best), "probes": [asdict(p) for p in probes]}
            result["ratio"] = result["batched"]["best"]["throughput_per_s"] / max(
                1e-9, result["single"]["best"]["throughput_per_s"])
            runs.append(result)
            progress(f"batching run {run + 1}: batched {result['batched']['best']['throughput_per_s']:.0f}/s, "
                      f"single {result['single']['best']['throughput_per_s']:.0f}/s, ratio {result['ratio']:.2f}")
    return {"model": model, "note": note, "runs": runs, "ratio": statistics.median(r["ratio"] for r in runs),
            "batched_per_s": statistics.median(r["batched"]["best"]["throughput_per_s"] for r in runs),
            "single_per_s": statistics.median(r["single"]["best"]["throughput_per_s"] for r in runs)}


# -- generation ------------------------------------------------------------------


def _generator(real_name: str, toy_step_ms: float) -> tuple[str, list[str], str]:
    if repository_model(real_name):
        return real_name, ["--model-repository", str(MODEL_REPO)], f"{real_name} (model_repo/{real_name}/1)"
    return ("toy-generator", ["--toy-compute-ms", str(toy_step_ms), "--num-kv-blocks", "1024"],
            f"toy generator, constant {toy_step_ms} ms per step: {real_name} not built")


def bench_continuous(profile: Profile) -> dict:
    model, worker_args, note = _generator("tinylm", 20.0)
    result = _continuous_vs_static(model, worker_args, profile)
    result["note"] = note
    if model != "toy-generator" and profile.constant_step_reference:
        # Reference: a step whose cost does not grow with the batch (like a memory-bound GPU decode).
        reference = _continuous_vs_static(
            "toy-generator", ["--toy-compute-ms", "10", "--num-kv-blocks", "1024"], profile)
        reference["note"] = "toy generator, constant 10 ms per step, 32 running sequences"
        result["constant_step_reference"] = reference
    return result


def _continuous_vs_static(model: str, worker_args: list[str], profile: Profile) -> dict:
    """Static batching as a fixed-shape batch runs it (finished members computed as padding until
    the longest ends: FasterTransformer, HF generate), and, for reference, with finished members
    dropping out of the steps (cheaper per step on a CPU, where step cost grows with the batch)."""
    runs = []
    with cluster([], [(model, worker_args)]) as continuous, \
            cluster([], [(model, worker_args)], STATIC_BATCHING) as static, \
            cluster(["--static-batch-padding", "false"], [(model, worker_args)], STATIC_BATCHING) as static_unpadded:
        max_num_seqs = declared_max_num_seqs(model)
        concurrency = 3 * max_num_seqs  # the queue never runs dry
        for run in range(profile.runs):
            result = {name: with_channel(target, lambda t: _saturate(t, model, concurrency, profile))
                      for name, target in (("continuous", continuous), ("static", static),
                                           ("static_unpadded", static_unpadded))}
            result["ratio"] = result["continuous"] / result["static"]
            result["unpadded_ratio"] = result["continuous"] / result["static_unpadded"]
            runs.append(result)
            progress(f"continuous run {run + 1} ({model}): {result['continuous']:.0f} vs {result['static']:.0f} "
                      f"tokens/s, ratio {result['ratio']:.2f} (static without padding "
                      f"{result['static_unpadded']:.0f}, ratio {result['unpadded_ratio']:.2f})")
        step = _step_split(continuous)
    return {"model": model, "max_num_seqs": max_num_seqs, "concurrency": concurrency, "runs": runs,
            "ratio": statistics.median(r["ratio"] for r in runs),
            "unpadded_ratio": statistics.median(r["unpadded_ratio"] for r in runs),
            "continuous_tokens_per_s": statistics.median(r["continuous"] for r in runs),
            "static_tokens_per_s": statistics.median(r["static"] for r in runs),
            "static_unpadded_tokens_per_s": statistics.median(r["static_unpadded"] for r in runs), "step": step}


async def _saturate(target: Cluster, model: str, concurrency: int, profile: Profile) -> float:
    """Closed loop: each client sends its next request as soon as the last one ends; output tokens/s
    over the measured window, after a warm-up that fills the running set. Output lengths are drawn
    log-uniformly from [4, 240] (ignore_eos, so each is exact)."""
    window_from_s = time.perf_counter() + profile.continuous_warmup_s
    window_to_s = window_from_s + profile.continuous_s
    token_times: list[float] = []

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < window_to_s:
            length = int(math.exp(rng.uniform(math.log(4), math.log(240))))
            request = generate_request(model, prompt_text(rng, rng.randint(6, 14)), length)
            result = await stream(target.stub, request, time.perf_counter(), keep_times=True)
            if result.code != "OK":
                raise RuntimeError(f"generate failed: {result.code}")
            token_times.extend(result.token_times_s)

    tasks = [asyncio.ensure_future(client(seed)) for seed in range(concurrency)]
    await asyncio.sleep(window_to_s - time.perf_counter())
    for task in tasks:
        task.cancel()  # cancelling the call aborts the sequence at the scheduler
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0.3)
    return sum(window_from_s <= t < window_to_s for t in token_times) / profile.continuous_s


def _step_split(target: Cluster) -> dict:
    """Mean step time and overhead from the scheduler's own step histograms."""
    samples = target.metrics()

    def total(name: str) -> float:
        return sum(v for (n, _), v in samples.items() if n == name)

    num_steps = total("infermesh_scheduler_step_seconds_count")
    step_s = total("infermesh_scheduler_step_seconds_sum") / max(1, num_steps)
    overhead_s = total("infermesh_scheduler_step_overhead_seconds_sum") / max(1, num_steps)
    return {"num_steps": num_steps, "mean_step_ms": 1000 * step_s, "mean_overhead_ms": 1000 * overhead_s}


def bench_chunked(profile: Profile) -> dict:
    model, worker_args, note = _generator("tinylm", 5.0)
    long_chars = LONG_PROMPT_CHARS if model == "tinylm" else TOY_LONG_PROMPT_CHARS

    def make_requests(rng: random.Random):
        while True:
            if rng.random() < 0.2:
                yield "long", generate_request(model, prompt_text(rng, rng.randint(*long_chars)), 16)
            else:
                yield "short", generate_request(model, prompt_text(rng, rng.randint(8, 20)), 32)

    async def mixed_load(target: Cluster, seed: int) -> dict:
        requests = make_requests(random.Random(seed + 1))
        measured_from_s = time.perf_counter() + CHUNKED_WARMUP_S
        done: list[tuple[str, StreamResult]] = []

        async def send() -> None:
            kind, request = next(requests)
            began = time.perf_counter()
            result = await stream(target.stub, request, began, keep_times=True)
            if result.code != "OK":
                raise RuntimeError(f"generate failed: {result.code}")
            if began >= measured_from_s:
                done.append((kind, result))

        await open_loop(send, profile.chunked_rate_per_s, CHUNKED_WARMUP_S + profile.chunked_s, 0.0,
                        random.Random(seed))
        ttft_ms = {"short": [], "long": []}
        for kind, result in done:
            ttft_ms[kind].append(1000 * result.ttft_s)
        # Decode stalls: gaps between a short request's tokens (a long prefill step stalls them).
        gaps_ms = [1000 * (b - a) for kind, r in done if kind == "short"
                   for a, b in zip(r.token_times_s, r.token_times_s[1:], strict=False)]
        return {"ttft_p99_ms": quantile(ttft_ms["short"] + ttft_ms["long"], 0.99),
                "short_ttft_p99_ms": quantile(ttft_ms["short"], 0.99),
                "short_ttft_p50_ms": quantile(ttft_ms["short"], 0.5),
                "long_ttft_p99_ms": quantile(ttft_ms["long"], 0.99),
                "short_inter_token_p99_ms": quantile(gaps_ms, 0.99),
                "num_short": len(ttft_ms["short"]), "num_long": len(ttft_ms["long"])}

    runs = []
    # Without chunking a whole prompt must fit one step, so that side's token budget is the longest
    # prompt (as vLLM requires max_num_batched_tokens >= max_model_len without chunked prefill).
    with cluster(["--long-prefill-chunk-tokens", str(CHUNK_TOKENS), "--max-num-batched-tokens", "256"],
                 [(model, worker_args)]) as chunked, \
            cluster(["--long-prefill-chunk-tokens", "0", "--max-num-batched-tokens", "1024"],
                    [(model, worker_args)]) as whole:
        for run in range(profile.runs):
            result = {name: with_channel(target, lambda t, s=run: mixed_load(t, s)) for name, target in
                      (("chunked", chunked), ("whole", whole))}
            result["short_ratio"] = result["chunked"]["short_ttft_p99_ms"] / result["whole"]["short_ttft_p99_ms"]
            result["all_ratio"] = result["chunked"]["ttft_p99_ms"] / result["whole"]["ttft_p99_ms"]
            runs.append(result)
            progress(f"chunked run {run + 1}: short TTFT p99 {result['chunked']['short_ttft_p99_ms']:.1f} vs "
                      f"{result['whole']['short_ttft_p99_ms']:.1f} ms, all {result['chunked']['ttft_p99_ms']:.1f} "
                      f"vs {result['whole']['ttft_p99_ms']:.1f} ms, short inter-token p99 "
                      f"{result['chunked']['short_inter_token_p99_ms']:.1f} vs "
                      f"{result['whole']['short_inter_token_p99_ms']:.1f} ms")
    return {"model": model, "note": note, "rate_per_s": profile.chunked_rate_per_s, "runs": runs,
            "short_ratio": statistics.median(r["short_ratio"] for r in runs),
            "all_ratio": statistics.median(r["all_ratio"] for r in runs),
            "chunked_short_p99_ms": statistics.median(r["chunked"]["short_ttft_p99_ms"] for r in runs),
            "whole_short_p99_ms": statistics.median(r["whole"]["short_ttft_p99_ms"] for r in runs),
            "chunked_all_p99_ms": statistics.median(r["chunked"]["ttft_p99_ms"] for r in runs),
            "whole_all_p99_ms": statistics.median(r["whole"]["ttft_p99_ms"] for r in runs),
            "chunked_inter_token_p99_ms": statistics.median(r["chunked"]["short_inter_token_p99_ms"] for r in runs),
            "whole_inter_token_p99_ms": statistics.median(r["whole"]["short_inter_token_p99_ms"] for r in runs)}


CHUNKED_WARMUP_S = 1.0
LONG_PROMPT_CHARS = (800, 1000)  # tinylm's max_seq_len is 1024
TOY_LONG_PROMPT_CHARS = (400, 480)  # the toy generator's is 512
CHUNK_TOKENS = 128
OVERHEAD_NUM_SEQS = 32
OVERHEAD_STEP_MS = 20.0


def bench_overhead(profile: Profile) -> dict:
    num_tokens = profile.overhead_tokens

    async def decode(target: Cluster) -> dict:
        began = time.perf_counter()
        results = await asyncio.gather(*(
            stream(target.stub, generate_request("toy-generator", "abc", num_tokens, who=f"t{i}"), began,
                   keep_times=True)
            for i in range(OVERHEAD_NUM_SEQS)))
        # Steady state only: every sequence decoding, none prefilling or finished.
        gaps = [b - a for r in results for a, b in zip(r.token_times_s[20:-10], r.token_times_s[21:-10], strict=False)]
        step_s = statistics.median(gaps)
        worker_s = statistics.median(r.worker_compute_s / r.num_tokens for r in results)
        return {"step_ms": 1000 * step_s, "worker_ms": 1000 * worker_s, "overhead_ms": 1000 * (step_s - worker_s),
                "overhead_ratio": (step_s - worker_s) / step_s}

    runs = []
    worker_args = ["--toy-compute-ms", str(OVERHEAD_STEP_MS), "--num-kv-blocks", "1024"]
    with cluster([], [("toy-generator", worker_args)]) as target:
        for run in range(profile.runs):
            runs.append(with_channel(target, decode))
            progress(f"overhead run {run + 1}: step {runs[-1]['step_ms']:.2f} ms, worker {runs[-1]['worker_ms']:.2f} ms,"
                      f" overhead {100 * runs[-1]['overhead_ratio']:.1f}%")
        split = _step_split(target)
    return {"num_seqs": OVERHEAD_NUM_SEQS, "worker_step_ms": OVERHEAD_STEP_MS, "runs": runs,
            "overhead_ratio": statistics.median(r["overhead_ratio"] for r in runs),
            "overhead_ms": statistics.median(r["overhead_ms"] for r in runs),
            "step_ms": statistics.median(r["step_ms"] for r in runs), "scheduler_metrics": split}


# -- fairness --------------------------------------------------------------------

FAIR_BATCH = 8
FAIR_BATCH_MS = 20.0


def bench_fairness(profile: Profile) -> dict:
    capacity_per_s = FAIR_BATCH / (FAIR_BATCH_MS / 1000)
    share_per_s = capacity_per_s / 2  # two tenants of equal weight
    light_per_s, heavy_per_s = share_per_s / 2, 5 * share_per_s
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3))
    worker_args = ["--toy-compute-ms", str(FAIR_BATCH_MS), "--max-batch-size", str(FAIR_BATCH)]

    async def light_p99(target: Cluster, heavy_tenant: str | None, seed: int) -> dict:
        light = classify_sender(target.stub, "toy-classifier", image, "light", 1.0)
        loads = [open_loop(light, light_per_s, profile.fairness_s, 0.5, random.Random(seed))]
        if heavy_tenant is not None:
            heavy = classify_sender(target.stub, "toy-classifier", image, heavy_tenant, 1.0)
            loads.append(open_loop(heavy, heavy_per_s, profile.fairness_s + 1.0, 0.0, random.Random(seed + 1)))
        outcomes = await asyncio.gather(*loads)
        light_ok = [o.latency_s for o in outcomes[0] if o.code == "OK"]
        result = {"light_p99_ms": 1000 * quantile(light_ok, 0.99), "light_p50_ms": 1000 * quantile(light_ok, 0.5),
                  "light_errors": len(outcomes[0]) - len(light_ok), "light_requests": len(outcomes[0]),
                  "light_send_lag_p99_ms": 1000 * quantile([o.lag_s for o in outcomes[0]], 0.99)}
        if heavy_tenant is not None:
            heavy_ok = [o for o in outcomes[1] if o.code == "OK"]
            result["heavy_goodput_per_s"] = len(heavy_ok) / (profile.fairness_s + 1.0)
            result["heavy_rejected_ratio"] = 1 - len(heavy_ok) / max(1, len(outcomes[1]))
        await asyncio.sleep(1.2)  # the flood's queue drains (1 s deadlines) before the next measurement
        return result

    runs = []
    with cluster([], [("toy-classifier", worker_args)]) as target:
        for run in range(profile.runs):
            result = {
                "alone": with_channel(target, lambda t, s=run: light_p99(t, None, s)),
                "flooded": with_channel(target, lambda t, s=run: light_p99(t, "heavy", s)),
                "one_queue": with_channel(target, lambda t, s=run: light_p99(t, "light", s)),
            }
            result["ratio"] = result["flooded"]["light_p99_ms"] / result["alone"]["light_p99_ms"]
            runs.append(result)
            progress(f"fairness run {run + 1}: light p99 alone {result['alone']['light_p99_ms']:.1f} ms, "
                      f"flooded {result['flooded']['light_p99_ms']:.1f} ms (ratio {result['ratio']:.2f}), "
                      f"one queue {result['one_queue']['light_p99_ms']:.1f} ms; the generator's send lag p99 alone "
                      f"{result['alone']['light_send_lag_p99_ms']:.1f} ms, flooded "
                      f"{result['flooded']['light_send_lag_p99_ms']:.1f} ms")
    return {"capacity_per_s": capacity_per_s, "light_per_s": light_per_s, "heavy_per_s": heavy_per_s, "runs": runs,
            "ratio": statistics.median(r["ratio"] for r in runs),
            "alone_p99_ms": statistics.median(r["alone"]["light_p99_ms"] for r in runs),
            "flooded_p99_ms": statistics.median(r["flooded"]["light_p99_ms"] for r in runs),
            "one_queue_p99_ms": statistics.median(r["one_queue"]["light_p99_ms"] for r in runs)}


# -- report ----------------------------------------------------------------------

SCENARIOS = {
    "batching": bench_batching,
    "continuous": bench_continuous,
    "chunked": bench_chunked,
    "overhead": bench_overhead,
    "fairness": bench_fairness,
}


def table_rows(results: dict) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, measured, ratio, target, met) per scenario that ran."""
    rows = []
    if r := results.get("batching"):
        rows.append(("dynamic batching: max classify/s at p99 <= 100 ms",
                     f"{r['batched_per_s']:.0f}/s vs {r['single_per_s']:.0f}/s unbatched ({r['model']})",
                     f"{r['ratio']:.2f}x", TARGETS["batching"], _met(r["ratio"] >= 4)))
    if r := results.get("continuous"):
        rows.append(("continuous vs static batching: output tokens/s",
                     f"{r['continuous_tokens_per_s']:.0f} vs {r['static_tokens_per_s']:.0f} ({r['model']})",
                     f"{r['ratio']:.2f}x", TARGETS["continuous"], _met(r["ratio"] >= 3)))
        rows.append(("  same run: static without padding (finished drop out)",
                     f"{r['continuous_tokens_per_s']:.0f} vs {r['static_unpadded_tokens_per_s']:.0f}",
                     f"{r['unpadded_ratio']:.2f}x", "-", "(info)"))
        if ref := r.get("constant_step_reference"):
            rows.append(("  same, constant-cost step (reference)",
                         f"{ref['continuous_tokens_per_s']:.0f} vs {ref['static_tokens_per_s']:.0f} (toy, 32 seqs)",
                         f"{ref['ratio']:.2f}x", TARGETS["continuous"], "(ref)"))
    if r := results.get("chunked"):
        rows.append(("chunked prefill: TTFT p99 of short prompts",
                     f"{r['chunked_short_p99_ms']:.1f} vs {r['whole_short_p99_ms']:.1f} ms ({r['model']})",
                     f"{r['short_ratio']:.2f}x", TARGETS["chunked"], _met(r["short_ratio"] <= 0.5)))
        # Long prompts' own first token comes later when spread over steps: the price of the above.
        rows.append(("  same run: TTFT p99 of all requests (long ones too)",
                     f"{r['chunked_all_p99_ms']:.1f} vs {r['whole_all_p99_ms']:.1f} ms",
                     f"{r['all_ratio']:.2f}x", "-", "(info)"))
        rows.append(("  same run: inter-token p99 of short requests",
                     f"{r['chunked_inter_token_p99_ms']:.1f} vs {r['whole_inter_token_p99_ms']:.1f} ms",
                     f"{r['chunked_inter_token_p99_ms'] / r['whole_inter_token_p99_ms']:.2f}x", "-", "(info)"))
    if r := results.get("overhead"):
        rows.append((f"scheduler<->worker overhead per step, {r['num_seqs']} seqs",
                     f"{r['overhead_ms']:.2f} ms of a {r['step_ms']:.2f} ms step ({r['worker_step_ms']:.0f} ms worker)",
                     f"{100 * r['overhead_ratio']:.1f}%", TARGETS["overhead"], _met(r["overhead_ratio"] <= 0.10)))
    if r := results.get("fairness"):
        rows.append(("fairness: light p99, heavy at 5x its share vs alone",
                     f"{r['flooded_p99_ms']:.1f} vs {r['alone_p99_ms']:.1f} ms (one shared queue: "
                     f"{r['one_queue_p99_ms']:.0f} ms)", f"{r['ratio']:.2f}x", TARGETS["fairness"],
                     _met(r["ratio"] <= 1.5)))
    return rows


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short run of each (about 2 minutes)")
    parser.add_argument("--runs", type=int, default=None, help="runs per scenario (median reported)")
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="scenarios to run (default: all)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    profile = QUICK if args.quick else FULL
    if args.runs:
        profile = Profile(**{**asdict(profile), "runs": args.runs})
    began = time.monotonic()
    results = {}
    for name in args.only or SCENARIOS:
        print(f"{name} ...", flush=True)
        results[name] = SCENARIOS[name](profile)
    elapsed_s = time.monotonic() - began
    rows = table_rows(results)
    print()
    print_table(rows)
    for name in ("batching", "continuous", "chunked"):
        if name in results and "not built" in results[name]["note"]:
            print(f"note ({name}): {results[name]['note']}")
    print(f"\n{profile.runs} run(s) per scenario, median shown; {elapsed_s:.0f} s in all")
    report = {
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_1m": os.getloadavg()[0], "python": platform.python_version()},
        "profile": asdict(profile),
        "quick": args.quick,
        "elapsed_s": elapsed_s,
        "table": [dict(zip(("benchmark", "measured", "ratio", "target", "met"), row, strict=True)) for row in rows],
        "results": results,
    }
    write_report(args.output, report)


if __name__ == "__main__":
    main()
