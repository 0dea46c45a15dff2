"""Pipelined steps under TPOT pacing (issue 36): a step that leaves a batch-class decode out for an
interactive class must not stop the next step from being planned ahead. Fake clock, each step taking what
test_tpot_pacing's GPU-like cost says of its batch; the fake worker fills in input_from_last_sample from the
last token it sampled for the sequence, as the worker's SequenceMirror does. Only the planner's decisions
are counted, never wall time."""

from __future__ import annotations

from collections import deque

from services.common.priority import Priority
from services.scheduler.step_plan import StepPlan
from services.scheduler.step_scheduler import StepScheduler

from .conftest import FakeClock, Transcript, assert_contiguous
from .test_pipelined_steps import PipelinedWorker
from .test_tpot_pacing import BATCH_TPOT_S, CAP_S, INTERACTIVE_TPOT_S, add, gpu_like, warmed


def never_eos(context: list[int]) -> int:
    return 97 + (sum(context) * 31 + len(context) * 17) % 26


def run_pipelined(scheduler: StepScheduler, clock: FakeClock, *, depth: int = 2, num_alone: int = 0,
                  max_steps: int = 500) -> tuple[Transcript, list[bool], list[float]]:
    """Keeps up to `depth` steps in flight whenever schedule_ahead() allows (after the first `num_alone`
    steps, sent one at a time), each taking gpu_like() of its batch on a worker that runs them in order.
    Returns what was streamed, whether each step with work was planned ahead, and when each step ended."""
    worker = PipelinedWorker(scheduler.kv.block_size)
    worker.next_token = never_eos
    transcript, ahead, ends = Transcript(), [], []
    in_flight: deque[tuple[StepPlan, dict[int, int], float]] = deque()
    for _ in range(max_steps):
        if not in_flight:
            if not scheduler.has_work():
                break
            plan = scheduler.schedule()
            if not plan.has_work():
                worker.run(plan)
                continue
            in_flight.append((plan, worker.run(plan), gpu_like(len(plan.seqs), plan.num_batched_tokens)))
            ahead.append(False)
        while len(ahead) > num_alone and len(in_flight) < depth and (plan := scheduler.schedule_ahead()) is not None:
            in_flight.append((plan, worker.run(plan), gpu_like(len(plan.seqs), plan.num_batched_tokens)))
            ahead.append(True)
        plan, sampled, took_s = in_flight.popleft()
        clock.advance(took_s)
        ends.append(clock())
        transcript.plans.append(plan)
        for delta in scheduler.update_from_output(plan, sampled, took_s):
            transcript.deltas[delta.seq_id].append(delta)
    return transcript, ahead, ends


def token_times(transcript: Transcript, ends: list[float], seq_id: int) -> list[float]:
    return [end for plan, end in zip(transcript.plans, ends, strict=True)
            if any(s.seq_id == seq_id and s.sample for s in plan.seqs)]


def mixed(clock: FakeClock) -> StepScheduler:
    """Six batch-class streams and two interactive ones: all eight decoding take 42.8 ms, past the 32 ms
    pace of the interactive ones, so batch decodes sit out steps in turn."""
    scheduler = warmed(clock)
    for seq_id in range(1, 7):
        add(scheduler, seq_id, Priority.SHEDDABLE, BATCH_TPOT_S)
    for seq_id in (7, 8):
        add(scheduler, seq_id, Priority.CRITICAL, INTERACTIVE_TPOT_S)
    return scheduler


def test_a_step_that_leaves_a_skipping_decode_out_is_still_followed_by_a_step_planned_ahead(clock):
    # The first tokens come one step at a time; from then on schedule() leaves batch decodes out.
    transcript, ahead, _ = run_pipelined(mixed(clock), clock, num_alone=3)
    assert [len(plan.seqs) for plan in transcript.plans[:4]] == [8, 8, 8, 5], "pacing binds"
    # Before the fix no step was planned ahead of one that left a sequence out: 13 of 41 were.
    assert sum(ahead[3:]) >= 0.9 * len(ahead[3:]), f"{sum(ahead[3:])} of {len(ahead[3:])} steps planned ahead"


def test_steps_planned_ahead_are_paced_as_one_step_at_a_time_paces_them(clock):
    transcript, ahead, ends = run_pipelined(mixed(clock), clock)
    sizes = [len(plan.seqs) for plan in transcript.plans]
    # Before the fix steps planned ahead held every running decode: 8 in each, 42.8 ms a token for all.
    assert sum(1 for n in sizes if n < 8) >= len(sizes) // 2, "batch decodes skip most steps planned ahead"
    assert sum(ahead) >= 0.9 * len(ahead), f"{sum(ahead)} of {len(ahead)} steps planned ahead"
    for seq_id in range(1, 9):
        assert len(transcript.token_ids(seq_id)) == 30, "every stream finishes"
        assert_contiguous(transcript, seq_id)
    for seq_id in (7, 8):
        times = token_times(transcript, ends, seq_id)
        # The interactive TPOT is kept as one step at a time keeps it (test_tpot_pacing), within a step's
        # fit error: a step planned ahead sees the decodes in flight, not yet their tokens.
        assert (times[-1] - times[0]) / (len(times) - 1) <= CAP_S * 1.05
    for seq_id in range(1, 7):
        times = token_times(transcript, ends, seq_id)
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) <= 0.8 * BATCH_TPOT_S, "a skipping decode still gets its token within its target"


def test_pipelined_streams_under_pacing_are_the_streams_of_one_step_at_a_time():
    one_clock = FakeClock()
    one_at_a_time, _, _ = run_pipelined(mixed(one_clock), one_clock, depth=1)
    for depth in (2, 3):
        clock = FakeClock()
        pipelined, _, _ = run_pipelined(mixed(clock), clock, depth=depth)
        for seq_id in range(1, 9):
            assert pipelined.token_ids(seq_id) == one_at_a_time.token_ids(seq_id), (depth, seq_id)
            assert [d.index for d in pipelined.deltas[seq_id]] == [d.index for d in one_at_a_time.deltas[seq_id]]
        # A decode left out of the step before comes back with its last token, or (a step in flight before
        # that one sampling it) with input_from_last_sample; the fake worker checks both inputs.
        returning = {s.input_from_last_sample for before, plan in zip(pipelined.plans, pipelined.plans[1:], strict=False)
                     for s in plan.seqs if s.num_generated and s.seq_id not in {b.seq_id for b in before.seqs}}
        assert returning == ({False} if depth == 2 else {False, True})
