"""Pipelined steps under TPOT pacing, simulated (issue 36): the real StepScheduler on a fake clock, a worker
whose step time grows with its batch as a GPU's does, and the step loop's rule of keeping up to `--depth`
steps in flight whenever schedule_ahead() plans one. Deterministic: the same figures on any machine.

    .venv/bin/python -m bench.scheduler.bench_sim_pipelined_pacing [--rates 10,15,20] [--seconds 30] [--depth 2]

Interactive (critical, TPOT target 50 ms) and batch (sheddable, 500 ms) streams arrive 1:1 as Poisson at each
rate; prompts 32-256 tokens, max_tokens 32-160, no EOS. Each rate runs with the targets sent (pacing on) and
without (off). Per run: the share of steps planned ahead; the share of steps leaving a running decode out;
the steps that waited for a result because the newest step in flight held a prompt chunk, and the full
plans (schedule()) that preempted nothing; the interactive streams' TPOT (mean time per token after the
first) p50 / p99 and the share within target; tokens per simulated second.
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from dataclasses import dataclass, field

from bench.harness.stats import quantile
from services.common.errors import ResourceExhausted
from services.scheduler.fair_queue import Priority, TenantContext
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import SamplingParams, SequenceStatus
from services.scheduler.step_plan import StepPlan
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.step_scheduler_config import StepSchedulerConfig
from services.scheduler.tokenizer import ByteTokenizer
from tools.testbed.fake_clock import FakeClock

CONFIG = StepSchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_seq_len=512,
                             max_prefill_chunk_tokens=256)
NUM_BLOCKS, BLOCK_SIZE = 4096, 16
# A GPU-like step: fixed launch and weights read, KV read per sequence, compute per token.
STEP_FIXED_S, STEP_PER_SEQ_S, STEP_PER_TOKEN_S = 0.008, 0.0008, 0.00004
INTERACTIVE_TPOT_S, BATCH_TPOT_S = 0.050, 0.500
TOKENIZER = ByteTokenizer(vocab_size=257, eos_token_id=256)
SAMPLED_TOKEN = 97  # never EOS: streams end at max_tokens


def step_cost_s(plan: StepPlan) -> float:
    return STEP_FIXED_S + STEP_PER_SEQ_S * len(plan.seqs) + STEP_PER_TOKEN_S * plan.num_batched_tokens


@dataclass
class Run:
    num_steps: int = 0
    num_ahead: int = 0
    num_left_out: int = 0  # steps leaving a running decode out
    num_after_chunk: int = 0  # full plans after a step whose prompt chunk needed its result
    num_full_no_preempt: int = 0  # full plans, with steps before them, that preempted nothing
    num_tokens: int = 0
    num_refused: int = 0
    token_times: dict[int, list[float]] = field(default_factory=dict)


def arrivals(rate_per_s: float, until_s: float, seed: int) -> list[tuple[float, bool, int, int]]:
    """(time, interactive, prompt tokens, max_tokens) of Poisson arrivals, interactive and batch 1:1."""
    rng, out, at_s = random.Random(seed), [], 0.0
    while (at_s := at_s + rng.expovariate(rate_per_s)) < until_s:
        out.append((at_s, rng.random() < 0.5, rng.randint(32, 256), rng.randint(32, 160)))
    return out


def warmed(clock: FakeClock) -> StepScheduler:
    """A scheduler whose step-time fit has seen batches of every size (as a worker's does after a while)."""
    scheduler = StepScheduler(CONFIG, KVBlockManager(NUM_BLOCKS, BLOCK_SIZE), TOKENIZER, clock)
    for num_seqs in range(1, CONFIG.max_num_seqs + 1, 3):
        for num_tokens in (num_seqs, num_seqs + 200):
            cost_s = STEP_FIXED_S + STEP_PER_SEQ_S * num_seqs + STEP_PER_TOKEN_S * num_tokens
            scheduler.latency.model.observe(num_seqs, num_tokens, cost_s)
    return scheduler


def simulate(rate_per_s: float, seconds: float, *, paced: bool, depth: int, seed: int) -> tuple[Run, dict[int, bool]]:
    clock = FakeClock(0.0)
    scheduler = warmed(clock)
    pending = deque(arrivals(rate_per_s, seconds, seed))
    interactive: dict[int, bool] = {}
    live: dict[int, bool] = {}  # sequences sent and not seen ended
    run = Run()
    in_flight: deque[tuple[StepPlan, float, float]] = deque()  # plan, cost, when it ends
    free_at_s = 0.0  # when the worker is through the steps sent

    def admit_until(until_s: float) -> None:
        while pending and pending[0][0] <= until_s:
            at_s, is_interactive, prompt_len, max_tokens = pending.popleft()
            clock.now_s = max(clock.now_s, at_s)
            seq_id = len(interactive) + 1
            priority = Priority.CRITICAL if is_interactive else Priority.SHEDDABLE
            target_s = (INTERACTIVE_TPOT_S if is_interactive else BATCH_TPOT_S) if paced else None
            interactive[seq_id] = live[seq_id] = is_interactive
            try:
                scheduler.add_request(seq_id, tuple(97 + i % 26 for i in range(prompt_len)),
                                      SamplingParams(max_tokens=max_tokens),
                                      TenantContext("interactive" if is_interactive else "batch", priority, 1),
                                      deadline_s=None, tpot_target_s=target_s)
            except ResourceExhausted:
                run.num_refused += 1

    def send(plan: StepPlan, ahead: bool) -> None:
        nonlocal free_at_s
        cost_s = step_cost_s(plan)
        free_at_s = max(free_at_s, clock()) + cost_s
        in_flight.append((plan, cost_s, free_at_s))
        run.num_steps += 1
        run.num_ahead += ahead
        run.num_left_out += _leaves_a_decode_out(scheduler, plan, in_flight, live)

    last: StepPlan | None = None  # the step whose result was applied last; None: the worker was idle
    while pending or scheduler.has_work() or in_flight:
        if not in_flight:
            if not scheduler.has_work():
                admit_until(pending[0][0])
                last = None
                continue
            plan = scheduler.schedule()
            if not plan.has_work():
                admit_until(pending[0][0] if pending else clock())
                last = None
                continue
            if last is not None:  # the step loop waited for `last`'s result to plan this one
                run.num_after_chunk += any(not s.sample for s in last.seqs)
                run.num_full_no_preempt += not plan.preempted_seq_ids
            send(plan, ahead=False)
        while len(in_flight) < depth and (ahead := scheduler.schedule_ahead()) is not None:
            send(ahead, ahead=True)
        last, cost_s, ends_s = in_flight.popleft()
        admit_until(ends_s)
        clock.now_s = ends_s
        sampled = {s.seq_id: SAMPLED_TOKEN for s in last.seqs if s.sample}
        for delta in scheduler.update_from_output(last, sampled, cost_s):
            run.num_tokens += len(delta.token_ids)
            run.token_times.setdefault(delta.seq_id, []).extend([ends_s] * len(delta.token_ids))
    return run, interactive


def _leaves_a_decode_out(scheduler: StepScheduler, plan: StepPlan, in_flight, seq_ids: dict[int, bool]) -> bool:
    """Whether a running sequence with tokens left after the steps in flight (`plan` the newest) has no
    decode in `plan`. `seq_ids`: every sequence sent; those that ended are dropped from it."""
    in_plan = {s.seq_id for s in plan.seqs}
    samples: dict[int, int] = {}
    for sent, _, _ in in_flight:
        for s in sent.seqs:
            samples[s.seq_id] = samples.get(s.seq_id, 0) + s.sample
    left_out = False
    for seq_id in list(seq_ids):
        seq = scheduler.get(seq_id)
        if seq is None:
            del seq_ids[seq_id]
        elif (seq.status is SequenceStatus.RUNNING and seq_id not in in_plan
              and seq.num_generated + samples.get(seq_id, 0) < seq.sampling.max_tokens
              and (seq_id in samples or seq.num_uncomputed_tokens == 1)):
            left_out = True
    return left_out


def tpot_s(times: list[float]) -> float | None:
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,15,20", help="streams per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=30.0, help="simulated seconds of arrivals")
    parser.add_argument("--depth", type=int, default=2, help="steps kept in flight (2: one step per command)")
    parser.add_argument("--seed", type=int, default=36)
    args = parser.parse_args()
    print(f"depth {args.depth}, {args.seconds:g} simulated s per run, seed {args.seed}\n")
    print("| rate/s | pacing | steps | ahead | left a decode out | waits after a chunk | full plans preempting nothing "
          "| interactive TPOT p50 / p99 ms | within 50 ms | tokens/s | refused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for rate in (float(r) for r in args.rates.split(",")):
        for paced in (True, False):
            run, interactive = simulate(rate, args.seconds, paced=paced, depth=args.depth, seed=args.seed)
            tpots = sorted(t for seq_id, times in run.token_times.items()
                           if interactive[seq_id] and (t := tpot_s(times)) is not None)
            within = sum(t <= INTERACTIVE_TPOT_S for t in tpots) / len(tpots)
            steps = run.num_steps
            print(f"| {rate:g} | {'on' if paced else 'off'} | {steps} | {run.num_ahead / steps:.0%} "
                  f"| {run.num_left_out / steps:.0%} | {run.num_after_chunk / steps:.0%} "
                  f"| {run.num_full_no_preempt / steps:.0%} "
                  f"| {quantile(tpots, 0.5) * 1000:.1f} / {quantile(tpots, 0.99) * 1000:.1f} | {within:.0%} "
                  f"| {run.num_tokens / max(t[-1] for t in run.token_times.values()):.0f} | {run.num_refused} |")


if __name__ == "__main__":
    main()
