"""Pipelined steps in the StepScheduler alone: schedule_ahead() plans step N+1 while N is in
flight, and what the clients see is exactly what one step at a time gives them. The fake worker
runs each plan when it is sent (a worker runs steps in the order sent); results are applied later."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import pytest

from services.scheduler.fair_queue import Priority
from services.scheduler.sequence import FinishReason, SamplingParams
from services.scheduler.step_plan import StepPlan

from .conftest import (
    EOS,
    FakePagedWorker,
    Transcript,
    assert_contiguous,
    fake_next_token,
    make_prompt,
    make_scheduler,
    run_steps,
    tenant,
)


def next_token_with_eos(context: list[int]) -> int:
    """Like conftest's fake model, but about one token in eleven is EOS."""
    h = (sum(context) * 31 + len(context) * 17) % 286
    return EOS if h % 11 == 0 else 97 + h % 26


class PipelinedWorker(FakePagedWorker):
    """Fills in input_from_last_sample from the token it sampled last for that sequence, as the
    worker's SequenceMirror does; fails if it has none."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size, next_token_with_eos)
        self.last_sample: dict[int, int] = {}

    def run(self, plan: StepPlan) -> dict[int, int]:
        resolved = []
        for step in plan.seqs:
            if step.input_from_last_sample:
                assert step.token_ids == () and not step.reset_block_table
                step = replace(step, token_ids=(self.last_sample.pop(step.seq_id),), input_from_last_sample=False)
            resolved.append(step)
        for seq_id in plan.finished_seq_ids:
            self.last_sample.pop(seq_id, None)
        sampled = super().run(StepPlan(plan.step_id, tuple(resolved), plan.finished_seq_ids))
        for step in resolved:
            self.last_sample.pop(step.seq_id, None)
        self.last_sample.update(sampled)
        return sampled


def add(scheduler, seq_ids, *, prompt_len=6, max_tokens=None, stop=()):
    for seq_id in seq_ids:
        scheduler.add_request(seq_id, make_prompt(seq_id, prompt_len + seq_id % 5),
                              SamplingParams(max_tokens=max_tokens or 3 + seq_id * 7 % 23, stop=stop),
                              tenant(), deadline_s=None)


def run_pipelined(scheduler, worker, clock, *, transcript=None, on_step=None, max_steps=2000) -> Transcript:
    """Keeps up to two steps in flight whenever schedule_ahead() allows, like GeneratePool's loop."""
    transcript = transcript or Transcript()
    in_flight: deque = deque()
    for step_index in range(max_steps):
        if not in_flight:
            if not scheduler.has_work():
                break
            plan = scheduler.schedule()
            transcript.plans.append(plan)
            if not plan.has_work():
                worker.run(plan)  # tells it to forget the finished ones
                continue
            in_flight.append((plan, worker.run(plan)))
        if len(in_flight) == 1 and (ahead := scheduler.schedule_ahead()) is not None:
            transcript.plans.append(ahead)
            in_flight.append((ahead, worker.run(ahead)))
        plan, sampled = in_flight.popleft()
        clock.advance(0.01)
        for delta in scheduler.update_from_output(plan, sampled):
            transcript.deltas[delta.seq_id].append(delta)
        if on_step is not None:
            on_step(step_index, scheduler)
    return transcript


def assert_same_streams(a: Transcript, b: Transcript, seq_ids) -> None:
    for seq_id in seq_ids:
        assert a.token_ids(seq_id) == b.token_ids(seq_id), seq_id
        assert a.text(seq_id) == b.text(seq_id), seq_id
        assert [d.index for d in a.deltas[seq_id]] == [d.index for d in b.deltas[seq_id]], seq_id
        last_a, last_b = a.last(seq_id), b.last(seq_id)
        assert (last_a.finish_reason, last_a.num_generated) == (last_b.finish_reason, last_b.num_generated), seq_id
        assert_contiguous(a, seq_id)


def test_the_next_step_is_planned_from_the_step_in_flight(clock):
    scheduler = make_scheduler(clock, block_size=4)
    add(scheduler, [1], prompt_len=6, max_tokens=5)
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert ahead is not None and scheduler.num_in_flight == 2
    (step,) = ahead.seqs
    assert step.input_from_last_sample and step.token_ids == () and step.sample
    # Prompt of 7 (6 + 1 % 5) at positions 0..6: the sampled token goes to position 7, in block 1.
    assert (step.start_position, step.new_blocks, step.num_generated, step.num_new_tokens) == (7, (), 1, 1)
    assert ahead.num_batched_tokens == 1
    worker = PipelinedWorker(4)
    worker.run(first)
    worker.run(ahead)
    # Position 8 needs a new block: planned ahead while step 2 is in flight, before step 1's result.
    scheduler.update_from_output(first, {1: 97})
    third = scheduler.schedule_ahead()
    assert third is not None and third.seqs[0].start_position == 8 and len(third.seqs[0].new_blocks) == 1


def test_streams_are_identical_to_one_step_at_a_time_with_eos_and_max_tokens_mixed(clock):
    seq_ids = range(1, 41)

    def run(pipelined: bool) -> Transcript:
        scheduler = make_scheduler(clock, num_blocks=256, block_size=4, max_num_seqs=24, max_num_batched_tokens=256)
        add(scheduler, seq_ids[:24])
        # A second wave arrives mid-run: admission breaks the pipeline for a step, then it resumes.
        late = {6: seq_ids[24:]}

        def arrive(step_index, s):
            if step_index in late:
                add(s, late.pop(step_index))

        worker = PipelinedWorker(4)
        if pipelined:
            return run_pipelined(scheduler, worker, clock, on_step=arrive)
        transcript = run_steps(scheduler, worker, clock, max_steps=7)
        add(scheduler, seq_ids[24:])
        return run_steps(scheduler, worker, clock, transcript=transcript)

    one_at_a_time, pipelined = run(False), run(True)
    assert_same_streams(pipelined, one_at_a_time, seq_ids)
    reasons = {one_at_a_time.last(s).finish_reason for s in seq_ids}
    assert reasons == {FinishReason.EOS, FinishReason.LENGTH}
    num_ahead = sum(any(s.input_from_last_sample for s in p.seqs) for p in pipelined.plans)
    assert num_ahead > len(pipelined.plans) / 2, "most steps were planned ahead"


@pytest.mark.parametrize("config", [
    {"max_num_batched_tokens": 16},  # chunks cut by the budget
    {"max_num_batched_tokens": 32, "max_prefill_chunk_tokens": 8},  # one long prefill at a time
    {"max_num_batched_tokens": 16, "num_blocks": 40},  # blocks run out: preemption, recomputed in chunks
])
def test_prompt_chunks_planned_ahead_give_the_streams_of_one_step_at_a_time(clock, config):
    seq_ids = range(1, 17)
    planned_ahead: list[StepPlan] = []

    def run(pipelined: bool) -> Transcript:
        scheduler = make_scheduler(clock, **{"num_blocks": 256, "max_seq_len": 128, **config})
        add(scheduler, seq_ids, prompt_len=30)
        worker = PipelinedWorker(4)
        if not pipelined:
            return run_steps(scheduler, worker, clock)
        schedule_ahead = scheduler.schedule_ahead

        def recorded() -> StepPlan | None:
            plan = schedule_ahead()
            planned_ahead.extend([plan] if plan is not None else [])
            return plan

        scheduler.schedule_ahead = recorded  # type: ignore[method-assign]
        return run_pipelined(scheduler, worker, clock)

    one_at_a_time, pipelined = run(False), run(True)
    assert_same_streams(pipelined, one_at_a_time, seq_ids)
    # Before issue 36 a step holding a prompt chunk that does not sample was never followed by one planned ahead.
    assert any(not s.sample and s.start_position > 0 and not s.reset_block_table for p in planned_ahead for s in p.seqs)
    if "num_blocks" in config:
        assert any(p.preempted_seq_ids for p in pipelined.plans)


def test_a_sequence_that_ends_at_n_is_dropped_from_n_plus_1_and_its_blocks_are_reused_only_later(clock):
    scheduler = make_and_add(clock, seq_ids := list(range(1, 9)))
    # The fake worker asserts a block written by one sequence is held by no other live table, so a
    # block of a sequence ended at N handed out while N+1 still writes it would fail here.
    worker = PipelinedWorker(4)
    transcript = run_pipelined(scheduler, worker, clock)
    reference = run_steps(make_and_add(clock, seq_ids), PipelinedWorker(4), clock)
    assert_same_streams(transcript, reference, seq_ids)
    assert scheduler.kv.num_used_blocks == 0 and scheduler.num_in_flight == 0


def make_and_add(clock, seq_ids):
    scheduler = make_scheduler(clock, num_blocks=8, block_size=4, max_num_batched_tokens=64, max_seq_len=32)
    add(scheduler, seq_ids, prompt_len=2, max_tokens=24)
    return scheduler


def test_max_tokens_reached_in_the_step_in_flight_plans_nothing_more(clock):
    scheduler = make_scheduler(clock)
    add(scheduler, [1], max_tokens=1)
    scheduler.schedule()
    assert scheduler.schedule_ahead() is None and scheduler.num_in_flight == 1


def test_the_next_prompt_chunk_is_planned_ahead_of_the_one_in_flight(clock):
    chunked = make_scheduler(clock, max_num_batched_tokens=8)
    add(chunked, [1], prompt_len=20)  # 21 tokens: chunks of 8, 8 and 5
    prompt = make_prompt(1, 21)
    first = chunked.schedule()
    second, third = chunked.schedule_ahead(), chunked.schedule_ahead()
    assert first.seqs[0].token_ids == prompt[:8]
    assert second is not None and third is not None
    (two,), (three,) = second.seqs, third.seqs
    assert (two.start_position, two.token_ids, two.sample, two.reset_block_table) == (8, prompt[8:16], False, False)
    assert (three.start_position, three.token_ids, three.sample) == (16, prompt[16:], True)
    worker = PipelinedWorker(4)
    for plan in (first, second, third):
        sampled = worker.run(plan)
    fourth = chunked.schedule_ahead()
    assert fourth is not None and fourth.seqs[0].input_from_last_sample and fourth.seqs[0].start_position == 21
    for plan in (first, second):
        assert chunked.update_from_output(plan, {}) == []
    (delta,) = chunked.update_from_output(third, sampled)
    assert delta.token_ids == (sampled[1],) and chunked.get(1).num_computed_tokens == 21


def test_missing_blocks_stop_the_steps_ahead_and_a_waiting_sequence_without_a_victim_does_not(clock):
    # Sequence 2 finds no slot, and schedule() would not preempt for it (its own tenant holds the slot;
    # the higher class's case is test_a_higher_class_waiting_for_a_slot_preempts_within_a_step): the
    # steps ahead go on decoding 1 (issue 36: they waited for schedule(), which then preempted nothing).
    waiting = make_scheduler(clock, max_num_seqs=1)
    add(waiting, [1, 2], max_tokens=10)
    first = waiting.schedule()
    ahead = waiting.schedule_ahead()
    assert ahead is not None and [s.seq_id for s in ahead.seqs] == [1]
    waiting.update_from_output(first, PipelinedWorker(4).run(first))
    third = waiting.schedule_ahead()
    assert third is not None and [s.seq_id for s in third.seqs] == [1] and waiting.num_waiting == 1

    # Two sequences fill all four blocks; their next positions need a fifth: preemption decides.
    full = make_scheduler(clock, num_blocks=4, block_size=4, max_seq_len=16)
    full.add_request(1, make_prompt(1, 8), SamplingParams(max_tokens=8), tenant(), deadline_s=None)
    full.add_request(2, make_prompt(2, 8), SamplingParams(max_tokens=8), tenant(), deadline_s=None)
    first = full.schedule()
    assert full.kv.num_free_blocks == 0
    assert full.schedule_ahead() is None
    full.update_from_output(first, FakePagedWorker(4).run(first))  # no EOS
    second = full.schedule()
    assert second.preempted_seq_ids, "with the result, the step preempts as before"


def test_an_expired_deadline_waits_for_the_result_and_then_aborts(clock):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, make_prompt(1, 4), SamplingParams(max_tokens=8), tenant(), deadline_s=clock() + 0.005)
    first = scheduler.schedule()
    clock.advance(0.01)
    assert scheduler.schedule_ahead() is None
    scheduler.update_from_output(first, PipelinedWorker(4).run(first))
    assert scheduler.schedule().expired_seq_ids == (1,)


def test_aborted_mid_pipeline_the_sequence_is_freed_now_and_forgotten_by_the_next_plan(clock):
    scheduler = make_scheduler(clock, block_size=4)
    add(scheduler, [1, 2], max_tokens=20)
    worker = PipelinedWorker(4)
    first = scheduler.schedule()
    ahead = scheduler.schedule_ahead()
    assert ahead is not None
    sampled_first, sampled_ahead = worker.run(first), worker.run(ahead)
    scheduler.abort(1)
    assert 1 not in scheduler.kv and scheduler.kv.num_used_blocks == len(scheduler.kv.block_table(2))
    deltas = scheduler.update_from_output(first, sampled_first)
    assert [d.seq_id for d in deltas] == [2]
    third = scheduler.schedule_ahead()
    assert third is not None and third.finished_seq_ids == (1,) and [s.seq_id for s in third.seqs] == [2]
    assert [d.seq_id for d in scheduler.update_from_output(ahead, sampled_ahead)] == [2]


def test_no_full_block_holding_a_dropped_token_is_registered_in_the_prefix_cache(clock):
    # Prompt "abc" + sampled tokens; the fake model's EOS at N is dropped, and the token N+1 computed
    # from it (written to the worker's block) must not make that block findable.
    scheduler = make_scheduler(clock, num_blocks=16, block_size=4, max_seq_len=64)

    def eos_after_two(context):
        return EOS if len(context) == 5 else 97 + len(context)

    worker = PipelinedWorker(4)
    worker.next_token = eos_after_two
    scheduler.add_request(1, (97, 98, 99), SamplingParams(max_tokens=10), tenant(), deadline_s=None)
    transcript = run_pipelined(scheduler, worker, clock)
    assert transcript.last(1).finish_reason is FinishReason.EOS and transcript.token_ids(1) == [100, 101]
    # Registered: only the block of positions 0..3 ("abc" + the first sample), never one of 4..7.
    assert scheduler.kv.num_cached_blocks == 1


def test_evicting_with_two_steps_in_flight_keeps_only_applied_tokens(clock):
    scheduler = make_scheduler(clock)
    add(scheduler, [1], max_tokens=20)
    worker = PipelinedWorker(4)
    first = scheduler.schedule()
    sampled = worker.run(first)
    scheduler.update_from_output(first, sampled)
    second = scheduler.schedule()
    worker.run(second)
    assert scheduler.schedule_ahead() is not None
    (seq,) = scheduler.evict_all()
    assert seq.num_generated == 1 and seq.num_computed_tokens == 0 and scheduler.num_in_flight == 0


def test_a_sequence_arriving_while_a_step_runs_is_admitted_in_the_step_planned_ahead(clock):
    scheduler = make_scheduler(clock, block_size=4)
    add(scheduler, [1], max_tokens=10)
    scheduler.schedule()
    add(scheduler, [2], max_tokens=10)
    ahead = scheduler.schedule_ahead()
    assert ahead is not None
    one, two = ahead.seqs
    assert one.input_from_last_sample and one.seq_id == 1
    assert (two.seq_id, two.reset_block_table, two.start_position, two.sample) == (2, True, 0, True)
    assert two.token_ids == make_prompt(2, 8)


def test_a_higher_class_waiting_for_a_slot_preempts_within_a_step(clock):
    scheduler = make_scheduler(clock, max_num_seqs=1)
    worker = PipelinedWorker(4)
    add(scheduler, [1], max_tokens=20)
    first = scheduler.schedule()
    scheduler.add_request(2, make_prompt(2, 4), SamplingParams(max_tokens=4), tenant("vip", Priority.CRITICAL),
                          deadline_s=None)
    ahead = scheduler.schedule_ahead()
    assert [s.seq_id for s in ahead.seqs] == [1]  # no slot for 2 without preempting
    scheduler.update_from_output(first, worker.run(first))
    assert scheduler.schedule_ahead() is None
    scheduler.update_from_output(ahead, worker.run(ahead))
    plan = scheduler.schedule()
    assert plan.preempted_seq_ids == (1,) and [s.seq_id for s in plan.seqs] == [2]


def test_a_waiting_tenant_under_its_share_stops_the_steps_ahead_only_once_fairness_may_preempt(clock):
    scheduler = make_scheduler(clock, max_num_seqs=2, fairness_min_run_s=0.1)
    worker = PipelinedWorker(4)
    worker.next_token = fake_next_token  # no EOS: heavy's sequences hold both slots
    for seq_id in (1, 2):
        scheduler.add_request(seq_id, make_prompt(seq_id, 4), SamplingParams(max_tokens=50), tenant("heavy"),
                              deadline_s=None)
    plan, started_s = scheduler.schedule(), clock()
    scheduler.add_request(3, make_prompt(3, 4), SamplingParams(max_tokens=4), tenant("light"), deadline_s=None)
    in_flight = deque([(plan, worker.run(plan))])
    # Until heavy's sequences have run fairness_min_run_s, no schedule() would preempt one for light's:
    # the steps go on being planned ahead.
    while clock() < started_s + 0.1 - 0.01:
        ahead = scheduler.schedule_ahead()
        assert ahead is not None and {s.seq_id for s in ahead.seqs} == {1, 2}
        in_flight.append((ahead, worker.run(ahead)))
        clock.advance(0.01)
        scheduler.update_from_output(*in_flight.popleft())
    clock.advance(0.02)
    ahead = scheduler.schedule_ahead()  # light's sequence finds a victim now: the step after is schedule()'s
    assert ahead is not None
    in_flight.append((ahead, worker.run(ahead)))
    scheduler.update_from_output(*in_flight.popleft())
    assert scheduler.schedule_ahead() is None
    scheduler.update_from_output(*in_flight.popleft())
    plan = scheduler.schedule()
    assert len(plan.preempted_seq_ids) == 1 and 3 in {s.seq_id for s in plan.seqs}
