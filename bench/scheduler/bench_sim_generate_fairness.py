"""The generate fairness scenario of bench_generate_fairness.py, simulated: the real StepScheduler
on a fake clock, with a step cost modelled on tinylm on one CPU thread, so the scheduling policy is
measured without the noise of a shared machine (or of the scheduler's own CPU).

    .venv/bin/python -m bench.scheduler.bench_sim_generate_fairness [--seeds N] [--option key=value ...]

A light tenant at 3 streams/s alone, then with a same-class, same-weight heavy tenant at 2x
capacity (heavy calls carry 5 s deadlines, as in the real benchmark); greedy, ignore EOS, prompts
8-48 tokens, max_tokens uniform in [8, 128]; 60 simulated seconds per phase after 3 s of warm-up.
`--classes critical` makes the light tenant critical and the flood sheddable.
Prints the light tenant's TTFT p99 and e2e p99 per seed and their medians. `--option` overrides a
StepSchedulerConfig field (e.g. enable_fairness_preemption=false) where the code has it.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import random
import statistics

from bench.harness.stats import quantile
from services.common.errors import ResourceExhausted
from services.scheduler.fair_queue import Priority, TenantContext
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.step_scheduler_config import StepSchedulerConfig
from services.scheduler.tokenizer import ByteTokenizer
from tools.testbed.fake_clock import FakeClock

# tinylm's envelope (model_repo/tinylm/1/manifest.json) and the scheduler's default chunking.
CONFIG = StepSchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, max_seq_len=1024,
                             max_prefill_chunk_tokens=64)
NUM_BLOCKS, BLOCK_SIZE = 1024, 16
# Step cost: fixed + per sequence (attention, sampling) + per token (matmuls); ~12 ms for 16 decodes,
# near what the real worker takes on one thread.
STEP_FIXED_S, STEP_PER_SEQ_S, STEP_PER_TOKEN_S = 0.002, 0.0006, 0.00005
LIGHT_PER_S, HEAVY_TIMEOUT_S = 3.0, 5.0
# Priority classes of (light, heavy): the same-class case, or a critical tenant against a sheddable flood.
CLASSES = {"same": (Priority.STANDARD, Priority.STANDARD), "critical": (Priority.CRITICAL, Priority.SHEDDABLE)}
WARMUP_S, WINDOW_S = 3.0, 60.0


def step_cost_s(plan) -> float:
    return STEP_FIXED_S + STEP_PER_SEQ_S * len(plan.seqs) + STEP_PER_TOKEN_S * plan.num_batched_tokens


def arrivals(who: str, rate_per_s: float, until_s: float, rng: random.Random) -> list[tuple[float, str, int, int]]:
    """(time, tenant, prompt tokens, max_tokens) of Poisson arrivals in [0, until_s)."""
    out, now_s = [], rng.expovariate(rate_per_s)
    while now_s < until_s:
        out.append((now_s, who, rng.randint(8, 48), rng.randint(8, 128)))
        now_s += rng.expovariate(rate_per_s)
    return out


def simulate(heavy_per_s: float, seed: int, options: dict, classes: str = "same") -> dict:
    """Light TTFT and e2e (seconds) of the streams sent after warm-up, and heavy completions/s."""
    clock = FakeClock(0.0)
    scheduler = StepScheduler(dataclasses.replace(CONFIG, **options), KVBlockManager(NUM_BLOCKS, BLOCK_SIZE),
                              ByteTokenizer(vocab_size=257, eos_token_id=256), clock)
    end_s = WARMUP_S + WINDOW_S
    priorities = dict(zip(("light", "heavy"), CLASSES[classes], strict=True))
    pending = arrivals("light", LIGHT_PER_S, end_s, random.Random(seed))
    if heavy_per_s:
        pending += arrivals("heavy", heavy_per_s, end_s + 5.0, random.Random(seed + 1000))
    heapq.heapify(pending)
    seqs, next_id, done, num_preempted = {}, 1, {"light": [], "heavy": []}, 0
    while pending or scheduler.has_work():
        while pending and pending[0][0] <= clock():
            at_s, who, prompt_len, max_tokens = heapq.heappop(pending)
            deadline_s = at_s + HEAVY_TIMEOUT_S if who == "heavy" else None
            try:
                seq = scheduler.add_request(next_id, tuple(97 + i % 26 for i in range(prompt_len)),
                                            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                            TenantContext(who, priorities[who]), deadline_s=deadline_s)
            except ResourceExhausted:
                continue  # the queue is full: refused, as the real scheduler refuses the call
            seqs[next_id] = (who, at_s, seq)
            next_id += 1
        plan = scheduler.schedule()
        if not plan.has_work():
            if not pending:
                break
            clock.now_s = pending[0][0]
            continue
        num_preempted += len(plan.preempted_seq_ids)
        clock.advance(step_cost_s(plan))
        sampled = {s.seq_id: 97 for s in plan.seqs if s.sample}
        for delta in scheduler.update_from_output(plan, sampled):
            if delta.finish_reason is not None:
                who, at_s, seq = seqs.pop(delta.seq_id)
                done[who].append((at_s, seq.first_token_s - at_s, clock() - at_s))
        if not pending and clock() > end_s + 5.0:
            break
    light = [(ttft, e2e) for at_s, ttft, e2e in done["light"] if at_s >= WARMUP_S]
    return {"light_ttft_p99_ms": 1000 * quantile([t for t, _ in light], 0.99),
            "light_ttft_p50_ms": 1000 * quantile([t for t, _ in light], 0.50),
            "light_e2e_p99_ms": 1000 * quantile([e for _, e in light], 0.99),
            "heavy_done_per_s": sum(1 for at_s, *_ in done["heavy"] if WARMUP_S <= at_s < end_s) / WINDOW_S,
            "preemptions_per_s": num_preempted / clock()}


def capacity_per_s() -> float:
    """Streams/s with every slot decoding (prefill cost left out): mean output length 68 tokens."""
    full_step_s = STEP_FIXED_S + (STEP_PER_SEQ_S + STEP_PER_TOKEN_S) * CONFIG.max_num_seqs
    return CONFIG.max_num_seqs / full_step_s / 68


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--classes", choices=sorted(CLASSES), default="same")
    parser.add_argument("--option", action="append", default=[], help="StepSchedulerConfig field=value")
    parser.add_argument("--quick", action="store_true", help="one seed (`make bench QUICK=1`)")
    args = parser.parse_args()
    if args.quick:
        args.seeds = 1
    options = {}
    for item in args.option:
        key, value = item.split("=", 1)
        options[key] = {"true": True, "false": False}.get(value.lower(), None)
        if options[key] is None:
            options[key] = float(value)
    capacity = capacity_per_s()
    print(f"capacity {capacity:.1f} streams/s; heavy offers {2 * capacity:.1f}/s")
    ratios = []
    for seed in range(args.seeds):
        alone = simulate(0.0, seed, options, args.classes)
        flooded = simulate(2 * capacity, seed, options, args.classes)
        ratios.append(flooded["light_ttft_p99_ms"] / alone["light_ttft_p99_ms"])
        print(f"seed {seed}: light TTFT p99 {alone['light_ttft_p99_ms']:.0f} -> {flooded['light_ttft_p99_ms']:.0f} ms "
              f"({ratios[-1]:.2f}x), p50 {alone['light_ttft_p50_ms']:.0f} -> {flooded['light_ttft_p50_ms']:.0f} ms, "
              f"e2e p99 {alone['light_e2e_p99_ms']:.0f} -> {flooded['light_e2e_p99_ms']:.0f} ms, "
              f"heavy done {flooded['heavy_done_per_s']:.1f}/s, preemptions {flooded['preemptions_per_s']:.1f}/s")
    print(f"median TTFT p99 ratio {statistics.median(ratios):.2f}x over {args.seeds} seeds")


if __name__ == "__main__":
    main()
