"""Prefix caching and cache-aware routing on real processes (issue 14): a scheduler and three
tinylm workers per configuration, called at the scheduler's own Generate RPC with each request's
TenantContext (no gateway).

    .venv/bin/python -m bench.scheduler.bench_prefix_cache [--quick] [--rounds N] [--rate CONVERSATIONS_PER_S]

Workload (bench/scheduler/prefix_workload.py), llm-d's prefix-cache benchmark scaled down to one 2-core
machine: 16 tenants (llm-d: 150), each with its own 500-token system prompt (llm-d: 6K tokens);
conversations arrive open-loop (Poisson, 18/s), 2-4 turns each, every turn resending the whole
history plus a 16-40 token user turn, 16-32 output tokens, a think time (mean 0.2 s) between an
answer and the next turn. Each worker's KV cache is cut to `num_kv_blocks` blocks of 16 tokens (tinylm's
manifest: 1024) so that, as in llm-d's setting, one worker cannot hold every tenant's prefix:
routing decides what stays cached.

Configurations, all four up at once and measured in turn within each round (so machine noise
falls on all of them): no prefix cache (least-loaded routing, as before issue 14); cache with
least-loaded, random, and cache-aware routing. Each round uses tenants of its own (a run tag in
their ids, hence in their cache salts): no round starts with what an earlier one cached.

Per configuration and round: TTFT p50/p90/p99 of the turns sent in the measured window (from
their scheduled send time: no coordinated omission; a turn without a first token when the round
is cut off counts with the time it had waited, a lower bound, and is counted), output tokens/s
received in the window, the scheduler's prefix-cache hit rate (its counters' increase over the
round) and the oracle's (an infinite per-tenant cache on the sequences actually sent), and the load
generator's lag (actual send minus scheduled). The table shows medians over rounds; the JSON
(bench/results/prefix_cache.json) has every round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import uvloop

from bench.harness.results import MODEL_REPO, RESULTS_DIR, write_report
from bench.harness.stats import quantile
from bench.scheduler.cluster import Cluster, cluster, tenant
from bench.scheduler.prefix_workload import (
    Conversation,
    OracleCache,
    WorkloadSpec,
    make_conversations,
    render_prompt,
    system_prompt,
)
from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.tokenizer import ByteTokenizer

RESULTS_PATH = RESULTS_DIR / "prefix_cache.json"
MODEL = "tinylm"
NUM_WORKERS = 3
BLOCK_SIZE = 16
TARGETS = {
    "ttft_p90": "cache-aware <= 0.3 x least-loaded with cache",
    "throughput": "cache-aware output tokens/s >= 1.5 x no cache",
    "hit_rate": "cache-aware hit rate >= 0.9 x oracle",
}
# name -> (--prefix-cache, --routing)
CONFIGS = {
    "no_cache": ("off", "least_loaded"),
    "least_loaded": ("on", "least_loaded"),
    "random": ("on", "random"),
    "cache_aware": ("on", "cache_aware"),
}


@dataclass(frozen=True)
class Profile:
    rounds: int
    duration_s: float  # conversations start over this window
    warmup_s: float  # turns sent before this are not measured (caches fill)
    drain_s: float  # after the window, how long turns already sent may finish before the cut-off
    conversations_per_s: float
    num_kv_blocks: int


FULL = Profile(rounds=3, duration_s=30.0, warmup_s=5.0, drain_s=5.0, conversations_per_s=18.0, num_kv_blocks=512)
QUICK = Profile(rounds=1, duration_s=12.0, warmup_s=3.0, drain_s=3.0, conversations_per_s=18.0, num_kv_blocks=512)


def scheduler_args(name: str) -> list[str]:
    cache, routing = CONFIGS[name]
    return ["--prefix-cache", cache, "--routing", routing]


# -- one round on one configuration -------------------------------------------------------


@dataclass
class Turn:
    tenant_id: str
    token_ids: tuple[int, ...]
    scheduled_s: float  # from the round's start
    sent_s: float = math.nan
    ttft_s: float = math.nan  # from scheduled_s
    num_tokens: int = 0
    code: str = "OK"
    token_times_s: list[float] = field(default_factory=list)  # from the round's start
    output_ids: list[int] = field(default_factory=list)

    @property
    def censored(self) -> bool:
        return math.isnan(self.ttft_s)


def prompt_request(prompt: str, max_tokens: int, tenant_id: str) -> scheduler_pb2.ScheduleGenerateRequest:
    return scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name=MODEL), prompt=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7)),
        tenant=tenant(tenant_id))


async def converse(stub, conversation: Conversation, spec: WorkloadSpec, began_s: float, tokenizer: ByteTokenizer,
                   turns: list[Turn]) -> None:
    """One conversation's turns in order, each after the previous answer and its think time."""
    system = system_prompt(conversation.tenant_id, spec.system_prompt_chars)
    exchanges: list[tuple[str, str]] = []
    scheduled_s = conversation.start_s
    for spec_turn in conversation.turns:
        scheduled_s += spec_turn.think_s
        await asyncio.sleep(max(0.0, began_s + scheduled_s - time.perf_counter()))
        prompt = render_prompt(system, exchanges, spec_turn.user_text)
        turn = Turn(conversation.tenant_id, tokenizer.encode(prompt), scheduled_s)
        turns.append(turn)
        turn.sent_s = time.perf_counter() - began_s
        answer = []
        try:
            async for response in stub.Generate(prompt_request(prompt, spec_turn.max_tokens, conversation.tenant_id),
                                                timeout=120):
                chunk = response.chunk
                if chunk.token_ids:
                    now_s = time.perf_counter() - began_s
                    if turn.num_tokens == 0:
                        turn.ttft_s = now_s - scheduled_s
                    turn.num_tokens += len(chunk.token_ids)
                    turn.token_times_s.extend([now_s] * len(chunk.token_ids))
                    turn.output_ids.extend(chunk.token_ids)
                answer.append(chunk.text)
        except grpc.aio.AioRpcError as exc:
            turn.code = exc.code().name
            return
        exchanges.append((spec_turn.user_text, "".join(answer)))
        scheduled_s = time.perf_counter() - began_s


async def run_round(target: Cluster, profile: Profile, spec: WorkloadSpec, run_tag: str,
                    tokenizer: ByteTokenizer) -> dict:
    conversations = make_conversations(spec, run_tag)
    before = cache_counters(target)
    turns: list[Turn] = []
    async with grpc.aio.insecure_channel(target.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        began_s = time.perf_counter() + 0.05
        tasks = [asyncio.ensure_future(converse(stub, c, spec, began_s, tokenizer, turns)) for c in conversations]
        cut_off_s = profile.duration_s + profile.drain_s
        await asyncio.wait(tasks, timeout=max(0.0, began_s + cut_off_s - time.perf_counter()))
        for task in tasks:
            task.cancel()  # cancelling the call aborts the sequence at the scheduler
        await asyncio.gather(*tasks, return_exceptions=True)
        cut_s = time.perf_counter() - began_s
    await wait_idle(target)
    after = cache_counters(target)
    return summarize(turns, profile, cut_s, before, after)


async def wait_idle(target: Cluster, timeout_s: float = 20.0) -> None:
    """Until the cancelled sequences are gone, so the next configuration's round has the CPUs."""
    give_up_s = time.monotonic() + timeout_s
    while time.monotonic() < give_up_s:
        samples = target.metrics()
        if sum(v for (name, _), v in samples.items() if name in (
                "infermesh_scheduler_running_sequences", "infermesh_scheduler_waiting_sequences")) == 0:
            return
        await asyncio.sleep(0.1)


def summarize(turns: list[Turn], profile: Profile, cut_s: float, before: dict[str, float],
              after: dict[str, float]) -> dict:
    window = (profile.warmup_s, profile.duration_s)
    measured = [t for t in turns if window[0] <= t.scheduled_s < window[1]]
    ttfts = [cut_s - t.scheduled_s if t.censored else t.ttft_s for t in measured if t.code == "OK" or t.censored]
    num_tokens = sum(window[0] <= s < window[1] for t in turns for s in t.token_times_s)
    lags = [t.sent_s - t.scheduled_s for t in turns if not math.isnan(t.sent_s)]
    oracle = OracleCache(BLOCK_SIZE).add_all((t.tenant_id, t.token_ids, t.output_ids)
                                             for t in sorted(turns, key=lambda t: t.sent_s))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    hit_blocks, queried_blocks = delta.get("hit_blocks", 0.0), delta.get("queried_blocks", 0.0)
    per_worker = sorted(v for k, v in delta.items() if k.startswith("queried_tokens:"))
    return {
        "num_turns": len(turns), "num_measured": len(measured),
        "num_censored": sum(t.censored for t in measured),
        "num_errors": sum(t.code != "OK" for t in measured),
        "ttft_p50_ms": 1000 * quantile(ttfts, 0.50), "ttft_p90_ms": 1000 * quantile(ttfts, 0.90),
        "ttft_p99_ms": 1000 * quantile(ttfts, 0.99),
        "output_tokens_per_s": num_tokens / (window[1] - window[0]),
        "hit_rate": hit_blocks / queried_blocks if queried_blocks else 0.0,
        "oracle_hit_rate": oracle.block_hit_rate,
        "oracle_token_hit_rate": oracle.token_hit_rate,
        "scheduler_counters": delta,
        # The busiest worker's share of the prompt tokens admitted (1/3: even; 1: one worker took all).
        "busiest_worker_share": per_worker[-1] / sum(per_worker) if per_worker and sum(per_worker) else math.nan,
        "lag_p50_ms": 1000 * quantile(lags, 0.50), "lag_p99_ms": 1000 * quantile(lags, 0.99),
        "lag_max_ms": 1000 * max(lags, default=math.nan),
    }


def cache_counters(target: Cluster) -> dict[str, float]:
    """The scheduler's prefix-cache counters for the model, summed over workers (0 when absent)."""
    names = {"infermesh_scheduler_prefix_cache_hit_blocks_total": "hit_blocks",
             "infermesh_scheduler_prefix_cache_queried_blocks_total": "queried_blocks",
             "infermesh_scheduler_prefix_cache_hit_tokens_total": "hit_tokens",
             "infermesh_scheduler_prefix_cache_queried_tokens_total": "queried_tokens",
             "infermesh_scheduler_prefix_cache_evictions_total": "evictions"}
    totals = dict.fromkeys(names.values(), 0.0)
    for (name, labels), value in target.metrics().items():
        label = dict(labels)
        if name in names and label.get("model", MODEL) == MODEL:
            totals[names[name]] += value
            if names[name] == "queried_tokens":  # each worker's share of the prompt tokens: the balance
                key = f"queried_tokens:{label.get('worker', '?')}"
                totals[key] = totals.get(key, 0.0) + value
    return totals


# -- the run ------------------------------------------------------------------------------


def run(profile: Profile, only: list[str]) -> dict:
    spec = WorkloadSpec(conversations_per_s=profile.conversations_per_s, duration_s=profile.duration_s)
    manifest = json.loads((MODEL_REPO / MODEL / "1" / "manifest.json").read_text())
    spec_tokenizer = manifest["generator"]["tokenizer"]
    tokenizer = ByteTokenizer(spec_tokenizer["vocab_size"], spec_tokenizer["eos_token_id"],
                              spec_tokenizer["bos_token_id"])
    longest = spec.max_prompt_chars(spec.max_tokens[1]) + 1 + spec.max_tokens[1]  # ASCII answers: a byte a token
    if longest > manifest["generator"]["inputs"]["max_seq_len"]:
        raise SystemExit(f"the workload's longest sequence ({longest} tokens) exceeds tinylm's max_seq_len")
    worker_args = ["--model-repository", str(MODEL_REPO), "--num-kv-blocks", str(profile.num_kv_blocks)]
    configs = [name for name in CONFIGS if name in only] if only else list(CONFIGS)
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    with ExitStack() as stack:
        clusters = {name: stack.enter_context(cluster(scheduler_args(name), [(MODEL, worker_args)] * NUM_WORKERS))
                    for name in configs}
        for index in range(profile.rounds):
            names = list(configs)
            names = names[index % len(names):] + names[:index % len(names)]  # each goes first once in 4
            for name in names:
                result = uvloop.run(run_round(clusters[name], profile, spec, f"r{index}-", tokenizer))
                rounds[name].append(result)
                print(f"  round {index + 1} {name:>12}: TTFT p50/p90/p99 {result['ttft_p50_ms']:.0f}/"
                      f"{result['ttft_p90_ms']:.0f}/{result['ttft_p99_ms']:.0f} ms, "
                      f"{result['output_tokens_per_s']:.0f} tokens/s, hit rate {result['hit_rate']:.2f} "
                      f"(oracle {result['oracle_hit_rate']:.2f}), busiest worker "
                      f"{result['busiest_worker_share']:.2f}, {result['num_censored']} cut off, "
                      f"lag p99 {result['lag_p99_ms']:.1f} ms", flush=True)
    medians = {name: {key: statistics.median(r[key] for r in results) for key in MEDIAN_KEYS}
               for name, results in rounds.items()}
    return {"profile": asdict(profile), "workload": asdict(spec), "configs": {n: scheduler_args(n) for n in configs},
            "rounds": rounds, "medians": medians,
            "verdicts": verdicts(medians)}


MEDIAN_KEYS = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "output_tokens_per_s", "hit_rate", "oracle_hit_rate",
               "busiest_worker_share", "num_censored", "lag_p99_ms", "lag_max_ms")


def verdicts(medians: dict[str, dict[str, float]]) -> dict[str, dict]:
    if any(name not in medians for name in CONFIGS):
        return {}
    aware, least, none = medians["cache_aware"], medians["least_loaded"], medians["no_cache"]
    ttft = aware["ttft_p90_ms"] / least["ttft_p90_ms"] if least["ttft_p90_ms"] else math.nan
    throughput = aware["output_tokens_per_s"] / none["output_tokens_per_s"] if none["output_tokens_per_s"] else math.nan
    hit = aware["hit_rate"] / aware["oracle_hit_rate"] if aware["oracle_hit_rate"] else math.nan
    return {"ttft_p90": {"ratio": ttft, "met": ttft <= 0.3, "target": TARGETS["ttft_p90"]},
            "throughput": {"ratio": throughput, "met": throughput >= 1.5, "target": TARGETS["throughput"]},
            "hit_rate": {"ratio": hit, "met": hit >= 0.9, "target": TARGETS["hit_rate"]}}


def table(results: dict) -> str:
    lines = ["| configuration | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | output tokens/s | hit rate | oracle | cut off | lag p99 ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, m in results["medians"].items():
        lines.append(f"| {name} | {m['ttft_p50_ms']:.0f} | {m['ttft_p90_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
                     f"{m['output_tokens_per_s']:.0f} | {m['hit_rate']:.2f} | {m['oracle_hit_rate']:.2f} | "
                     f"{m['num_censored']:.0f} | {m['lag_p99_ms']:.1f} |")
    lines.append("")
    for name, verdict in results["verdicts"].items():
        lines.append(f"- {name}: {verdict['target']}: {verdict['ratio']:.2f} ({'met' if verdict['met'] else 'NOT met'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (about 2 minutes)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per configuration (medians reported)")
    parser.add_argument("--rate", type=float, default=None, help="conversations started per second")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker")
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="configurations to run (default: all)")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    profile = QUICK if args.quick else FULL
    overrides = {"rounds": args.rounds, "conversations_per_s": args.rate, "num_kv_blocks": args.num_kv_blocks}
    profile = Profile(**{**asdict(profile), **{k: v for k, v in overrides.items() if v is not None}})
    began_s = time.monotonic()
    results = run(profile, args.only or [])
    results["elapsed_s"] = time.monotonic() - began_s
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version()}
    text = table(results)
    print()
    print(text)
    write_report(args.output, results)
    args.output.with_suffix(".md").write_text(text + "\n")
    print(f"\n{results['elapsed_s']:.0f} s; JSON in {args.output}")


if __name__ == "__main__":
    main()
