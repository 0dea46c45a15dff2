"""Per-token pacing (scheduler/tpot_pacing.py): a step kept within the tightest TPOT target running, batch-class
decodes skipping steps for an interactive class and taking turns. Fake clock: each step takes what a GPU-like
cost says of its batch."""

from __future__ import annotations

import pytest

from services.common.priority import Priority
from services.scheduler.latency_predictor import StepCost
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import StepPlan
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.tpot_pacing import (
    MAX_SLACK_STEPS,
    PACE_MARGIN,
    PACE_MIN_PROMPT_TOKENS,
    step_cap_s,
    step_pace,
)

from .conftest import FakeClock, FakePagedWorker, make_prompt, make_scheduler, tenant

INTERACTIVE_TPOT_S = 0.040
BATCH_TPOT_S = 1.0
CAP_S = PACE_MARGIN * INTERACTIVE_TPOT_S


def gpu_like(num_seqs: int, num_tokens: int) -> float:
    """10 ms fixed, 4 ms per sequence (its KV read), 0.1 ms per token computed."""
    return 0.010 + 0.004 * num_seqs + 0.0001 * num_tokens


def warmed(clock: FakeClock, **over) -> StepScheduler:
    """A scheduler whose step-time fit has already seen batches of every size."""
    config = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_seq_len": 256, "num_blocks": 256, **over}
    scheduler = make_scheduler(clock, **config)
    for num_seqs in range(1, 9):
        for num_tokens in (num_seqs, num_seqs + 40):
            scheduler.latency.model.observe(num_seqs, num_tokens, gpu_like(num_seqs, num_tokens))
    return scheduler


def add(scheduler: StepScheduler, seq_id: int, priority: Priority, tpot_target_s: float | None, *,
        prompt_len: int = 4, max_tokens: int = 30) -> None:
    scheduler.add_request(seq_id, make_prompt(seq_id, prompt_len), SamplingParams(max_tokens=max_tokens),
                          tenant(priority.name.lower(), priority), deadline_s=None, tpot_target_s=tpot_target_s)


def run(scheduler: StepScheduler, clock: FakeClock, max_steps: int = 500,
        worker: FakePagedWorker | None = None) -> list[tuple[StepPlan, float]]:
    """Every step until nothing is left, each taking gpu_like() of its batch; the plans and their times."""
    worker = worker or FakePagedWorker(scheduler.kv.block_size)
    steps = []
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
        plan = scheduler.schedule()
        if not plan.has_work():
            continue
        took_s = gpu_like(len(plan.seqs), plan.num_batched_tokens)
        clock.advance(took_s)
        scheduler.update_from_output(plan, worker.run(plan), took_s)
        steps.append((plan, took_s))
    return steps


def token_times(steps: list[tuple[StepPlan, float]], seq_id: int) -> list[float]:
    """When each step that sampled `seq_id` ended (seconds from the first step's start)."""
    times, now = [], 0.0
    for plan, took_s in steps:
        now += took_s
        if any(s.seq_id == seq_id and s.sample for s in plan.seqs):
            times.append(now)
    return times


def test_batch_decodes_skip_steps_so_the_interactive_ones_keep_their_tpot(clock):
    scheduler = warmed(clock)
    for seq_id in range(1, 7):
        add(scheduler, seq_id, Priority.SHEDDABLE, BATCH_TPOT_S)
    for seq_id in (7, 8):
        add(scheduler, seq_id, Priority.CRITICAL, INTERACTIVE_TPOT_S)
    steps = run(scheduler, clock)
    # All eight decoding would take gpu_like(8, 8) = 42.8 ms, past the 32 ms pace of the interactive ones.
    assert gpu_like(8, 8) > CAP_S
    decode_steps = steps[1:]
    while decode_steps and not any(s.seq_id in (7, 8) for s in decode_steps[-1][0].seqs):
        decode_steps.pop()  # the batch sequences' tail, once the interactive ones are done
    assert any(len(plan.seqs) < 8 for plan, _ in decode_steps), "batch decodes must have skipped"
    assert all(took_s <= MAX_SLACK_STEPS * CAP_S for _, took_s in decode_steps)
    for seq_id in (7, 8):
        times = token_times(steps, seq_id)
        assert len(times) == 30
        # Their mean time per token after the first is kept (a step may spend the slack faster ones left).
        assert (times[-1] - times[0]) / (len(times) - 1) <= CAP_S + 1e-4
    for seq_id in range(1, 7):
        times = token_times(steps, seq_id)
        assert len(times) == 30, "every batch sequence still finishes"
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) <= PACE_MARGIN * BATCH_TPOT_S
        assert max(gaps) <= 3 * CAP_S, "skipping batch sequences take turns, none is left to its target"


def test_without_targets_every_running_sequence_decodes_every_step_as_before(clock):
    scheduler = warmed(clock)
    for seq_id in range(1, 7):
        add(scheduler, seq_id, Priority.SHEDDABLE, None)
    for seq_id in (7, 8):
        add(scheduler, seq_id, Priority.CRITICAL, None)
    steps = run(scheduler, clock)
    assert [len(plan.seqs) for plan, _ in steps] == [8] * 30


def test_no_sequence_skips_without_a_higher_class_here(clock):
    scheduler = warmed(clock)
    for seq_id in range(1, 9):
        add(scheduler, seq_id, Priority.SHEDDABLE, INTERACTIVE_TPOT_S if seq_id == 1 else BATCH_TPOT_S)
    steps = run(scheduler, clock)
    assert [len(plan.seqs) for plan, _ in steps] == [8] * 30, "one class: the cap cuts prompts, never decodes"


def test_a_newcomers_prompt_is_cut_to_the_cap_next_to_interactive_decodes(clock):
    scheduler, worker = warmed(clock), FakePagedWorker(4)
    target_s = 0.039  # cap 31.2 ms: three decodes and a newcomer leave ~4.9 ms, ~49 prompt tokens
    for seq_id in (1, 2, 3):
        # Their first tokens just came and one is left: no slack, no later steps to spread a long one over.
        add(scheduler, seq_id, Priority.CRITICAL, target_s, max_tokens=2)
    run(scheduler, clock, max_steps=1, worker=worker)
    add(scheduler, 4, Priority.CRITICAL, target_s, prompt_len=100, max_tokens=4)
    plan = scheduler.schedule()
    chunk = next(s for s in plan.seqs if s.seq_id == 4)
    assert 40 <= len(chunk.token_ids) <= 50, "unpaced it would compute 61 (the budget less three decodes)"
    assert gpu_like(len(plan.seqs), plan.num_batched_tokens) <= PACE_MARGIN * target_s + 0.0002  # the fit, not exact


def test_a_target_the_decodes_alone_fill_still_lets_a_newcomers_prompt_in_at_the_floor(clock):
    scheduler, worker = warmed(clock), FakePagedWorker(4)
    for seq_id in range(1, 7):  # six decodes: 34.2 ms, past the 32 ms cap on their own
        add(scheduler, seq_id, Priority.CRITICAL, INTERACTIVE_TPOT_S, max_tokens=2)
    run(scheduler, clock, max_steps=1, worker=worker)
    add(scheduler, 7, Priority.CRITICAL, INTERACTIVE_TPOT_S, prompt_len=100, max_tokens=4)
    plan = scheduler.schedule()
    chunk = next(s for s in plan.seqs if s.seq_id == 7)
    assert len(chunk.token_ids) == PACE_MIN_PROMPT_TOKENS, "never admitted at all would stall it for their lifetime"


def test_the_predicted_ttft_counts_the_smaller_budget_the_cap_leaves(clock):
    scheduler = warmed(clock)
    worker = FakePagedWorker(scheduler.kv.block_size)
    add(scheduler, 1, Priority.CRITICAL, None, max_tokens=20)
    run(scheduler, clock, max_steps=2, worker=worker)
    unpaced = scheduler.predicted_latency(Priority.CRITICAL, num_prompt_tokens=200).ttft_s
    add(scheduler, 2, Priority.CRITICAL, INTERACTIVE_TPOT_S, max_tokens=20)
    run(scheduler, clock, max_steps=2, worker=worker)
    paced = scheduler.predicted_latency(Priority.CRITICAL, num_prompt_tokens=200).ttft_s
    # 200 prompt tokens: 4 steps at the full budget of 64; the 32 ms cap leaves ~50 a step: 5 steps.
    assert paced > unpaced


def test_a_decode_may_skip_only_within_its_own_target_and_below_a_higher_class():
    cost = StepCost(0.010, 0.004, 0.0001)
    batch = _running(Priority.SHEDDABLE, tpot_target_s=0.2, last_token_s=1.0)
    interactive = _running(Priority.CRITICAL, tpot_target_s=0.05, last_token_s=1.0)
    pace = step_pace(cost, [batch, interactive], None, step_s=0.03, now_s=1.0)
    assert pace is not None and pace.cap_s == pytest.approx(PACE_MARGIN * 0.05)
    assert pace.may_skip(batch) and not pace.may_skip(interactive)
    late = step_pace(cost, [batch, interactive], None, step_s=0.03, now_s=1.11)
    assert late is not None and not late.may_skip(batch), "1.11 + 2 steps is past 0.8 x 200 ms after its last token"
    alone = step_pace(cost, [batch], None, step_s=0.03, now_s=1.0)
    assert alone is not None and not alone.may_skip(batch), "no higher class running or waiting"
    behind = step_pace(cost, [batch], Priority.CRITICAL, step_s=0.03, now_s=1.0)
    assert behind is not None and behind.may_skip(batch), "an interactive sequence waits behind it"
    assert step_pace(cost, [_running(Priority.CRITICAL, None, 1.0)], None, step_s=0.03, now_s=1.0) is None


def test_the_cap_leaves_tokens_for_what_fits_and_none_past_it():
    pace = step_pace(StepCost(0.010, 0.004, 0.0001), [_running(Priority.CRITICAL, 0.05, 0.0)], None,
                     step_s=0.02, now_s=0.0)
    assert pace is not None
    # 40 ms cap; a step of 2 sequences and 2 tokens, one more sequence: 22.2 ms, 17.8 ms left: 178 tokens.
    assert pace.tokens_allowed(2, 2) == 178
    assert pace.tokens_allowed(7, 7) == 0
    assert pace.token_budget(2) == pace.tokens_allowed(2, 0)
    assert pace.token_budget(8) == 8 + PACE_MIN_PROMPT_TOKENS, "past the cap: the decodes and the floor"


def test_a_longer_step_is_allowed_as_far_as_the_streams_other_steps_pay_for_it_within_bounds():
    paced_s = PACE_MARGIN * 0.050
    assert step_cap_s(0.050, 0, 0.0, 0, 0.020) == pytest.approx(paced_s), "its last token, right after its first"
    assert step_cap_s(0.050, 4, 4 * 0.035, 0, 0.020) == pytest.approx(5 * paced_s - 0.140), "4 at 35 ms: 60 ms"
    assert step_cap_s(0.050, 40, 40 * 0.010, 0, 0.020) == pytest.approx(MAX_SLACK_STEPS * paced_s), "bounded"
    assert step_cap_s(0.050, 4, 4 * 0.060, 0, 0.020) == pytest.approx(paced_s), "behind its pace: one paced step"
    # A fresh stream with 30 tokens to go: later steps of 20 ms pay for a long one; steps at its pace do not.
    assert step_cap_s(0.050, 0, 0.0, 30, 0.020) == pytest.approx(MAX_SLACK_STEPS * paced_s)
    assert step_cap_s(0.050, 0, 0.0, 30, paced_s) == pytest.approx(paced_s)
    assert step_cap_s(0.050, 0, 0.0, 2, 0.030) == pytest.approx(3 * paced_s - 2 * 0.030), "two later steps: 60 ms"


def _running(priority: Priority, tpot_target_s: float | None, last_token_s: float):
    """A decode whose first token just came, with no later step to spread a longer one over."""
    scheduler = make_scheduler(FakeClock())
    seq = scheduler.add_request(1, make_prompt(1, 4), SamplingParams(max_tokens=1), tenant("t", priority),
                                deadline_s=None, tpot_target_s=tpot_target_s)
    seq.num_computed_tokens = seq.num_tokens - 1  # a decode
    seq.first_token_s = seq.last_token_s = last_token_s  # its first token, just now
    return seq


def test_batch_decodes_yield_the_budget_to_an_interactive_prompt_not_to_a_batch_one(clock):
    for newcomer, yields in ((Priority.CRITICAL, True), (Priority.SHEDDABLE, False)):
        scheduler, worker = warmed(clock, max_num_batched_tokens=40), FakePagedWorker(4)
        add(scheduler, 1, Priority.CRITICAL, 10.0)  # loose: no cap to speak of; it only makes batch skippable
        for seq_id in (2, 3):
            add(scheduler, seq_id, Priority.SHEDDABLE, BATCH_TPOT_S)
        run(scheduler, clock, max_steps=1, worker=worker)
        add(scheduler, 4, newcomer, 10.0 if newcomer is Priority.CRITICAL else BATCH_TPOT_S, prompt_len=100)
        plan = scheduler.schedule()
        in_step = {s.seq_id: len(s.token_ids) for s in plan.seqs}
        if yields:
            assert in_step == {1: 1, 4: 39}, "the interactive prompt takes what the batch decodes leave"
        else:
            assert in_step == {1: 1, 2: 1, 3: 1, 4: 37}, "a batch prompt waits behind the batch decodes"
