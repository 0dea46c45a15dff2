from __future__ import annotations

import dataclasses

import pytest

from services.common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from services.scheduler.fair_queue import Priority
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import AbortReason, FinishReason, SamplingParams, SequenceStatus
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.tokenizer import ByteTokenizer

from .conftest import (
    EOS,
    FakePagedWorker,
    Transcript,
    assert_contiguous,
    fake_next_token,
    first_step_of_each_sequence,
    make_prompt,
    make_requests,
    make_scheduler,
    run_steps,
    tenant,
)


def steps_by_id(plan):
    return {s.seq_id: s for s in plan.seqs}


def expected_tokens(seq_id: int, prompt_len: int, max_tokens: int) -> list[int]:
    context = list(make_prompt(seq_id, prompt_len))
    out = []
    for _ in range(max_tokens):
        out.append(fake_next_token(context + out))
    return out


# -- the step ------------------------------------------------------------------


def test_first_step_computes_the_prompt_and_later_steps_one_token(clock):
    scheduler = make_scheduler(clock, block_size=4)
    make_requests(scheduler, 1, prompt_len=6)
    worker = FakePagedWorker(4)

    first = scheduler.schedule()
    (step,) = first.seqs
    assert (step.start_position, len(step.token_ids), step.sample, step.reset_block_table) == (0, 6, True, True)
    assert step.new_blocks == (0, 1)
    scheduler.update_from_output(first, worker.run(first))

    second = scheduler.schedule()
    (step,) = second.seqs
    assert step.token_ids == (fake_next_token(list(make_prompt(1, 6))),)
    assert (step.start_position, step.reset_block_table, step.new_blocks, step.num_generated) == (6, False, (), 1)


def test_long_prompt_is_chunked_while_decodes_keep_flowing(clock):
    scheduler = make_scheduler(clock, max_num_batched_tokens=16, max_seq_len=256)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 2, prompt_len=4, max_tokens=20)
    run_steps(scheduler, worker, clock, max_steps=1)  # both prompts computed
    make_requests(scheduler, 1, prompt_len=100, first_id=3)

    chunks = []
    for _ in range(8):
        plan = scheduler.schedule()
        steps = steps_by_id(plan)
        assert len(steps[1].token_ids) == len(steps[2].token_ids) == 1, "decodes must run every step"
        assert plan.num_batched_tokens <= 16
        if 3 in steps:
            chunks.append((steps[3].start_position, len(steps[3].token_ids), steps[3].sample))
        scheduler.update_from_output(plan, worker.run(plan))
    assert chunks[:3] == [(0, 14, False), (14, 14, False), (28, 14, False)]
    assert chunks[-1][0] + chunks[-1][1] == 100 and chunks[-1][2] is True


def test_prefill_chunk_cap_limits_one_sequences_share_of_the_step(clock):
    scheduler = make_scheduler(clock, max_num_batched_tokens=32, max_prefill_chunk_tokens=8,
                               max_long_partial_prefills=0)
    make_requests(scheduler, 3, prompt_len=20)
    plan = scheduler.schedule()
    assert [len(s.token_ids) for s in plan.seqs] == [8, 8, 8]


def test_one_long_prompt_prefills_at_a_time_and_short_ones_are_admitted_past_the_others(clock):
    # Budget 16, chunks of 8: prompts 1 and 2 (20 tokens) need three chunks, 3 and 4 (6 tokens) one.
    scheduler = make_scheduler(clock, max_num_batched_tokens=16, max_prefill_chunk_tokens=8, max_seq_len=64)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 2, prompt_len=20, max_tokens=4)
    make_requests(scheduler, 2, prompt_len=6, max_tokens=4, first_id=3)
    transcript = run_steps(scheduler, worker, clock)
    plans = [p for p in transcript.plans if p.has_work()]
    # Long 1 takes a chunk; long 2 must wait; the shorts are admitted past it in the same step.
    assert [(s.seq_id, s.start_position, len(s.token_ids)) for s in plans[0].seqs] == [(1, 0, 8), (3, 0, 6), (4, 0, 2)]
    for plan in plans:
        # "Long": more than one chunk (8 tokens) of its 20-token prompt still to compute.
        long_ones = [s.seq_id for s in plan.seqs if s.seq_id in (1, 2) and 20 - s.start_position > 8]
        assert len(long_ones) <= 1, plan
    first_of_2 = next(i for i, p in enumerate(plans) if any(s.seq_id == 2 for s in p.seqs))
    steps_of_1 = [s for p in plans[:first_of_2] for s in p.seqs if s.seq_id == 1]
    assert sum(len(s.token_ids) for s in steps_of_1) >= 12  # 2 started once 1 had one chunk left
    for seq_id, prompt_len in ((1, 20), (2, 20), (3, 6), (4, 6)):
        assert_contiguous(transcript, seq_id)
        assert transcript.token_ids(seq_id) == expected_tokens(seq_id, prompt_len, 4)


def test_without_a_long_prefill_limit_long_prompts_fill_the_budget_first(clock):
    scheduler = make_scheduler(clock, max_num_batched_tokens=16, max_prefill_chunk_tokens=8, max_seq_len=64,
                               max_long_partial_prefills=0)
    make_requests(scheduler, 2, prompt_len=20, max_tokens=4)
    make_requests(scheduler, 1, prompt_len=6, max_tokens=4, first_id=3)
    assert [(s.seq_id, len(s.token_ids)) for s in scheduler.schedule().seqs] == [(1, 8), (2, 8)]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole(clock):
    scheduler = make_scheduler(clock, max_num_batched_tokens=16, enable_chunked_prefill=False)
    make_requests(scheduler, 2, prompt_len=10)
    plan = scheduler.schedule()
    assert [(s.seq_id, len(s.token_ids)) for s in plan.seqs] == [(1, 10)]
    with pytest.raises(InvalidArgument, match="exceeds max_num_batched_tokens 16 and chunked prefill is off"):
        make_requests(scheduler, 1, prompt_len=17, first_id=9)


def test_respects_max_num_seqs_and_the_token_budget(clock):
    scheduler = make_scheduler(clock, max_num_seqs=3, max_num_batched_tokens=20)
    make_requests(scheduler, 5, prompt_len=4)
    plan = scheduler.schedule()
    assert [s.seq_id for s in plan.seqs] == [1, 2, 3]
    assert scheduler.num_running == 3 and scheduler.num_waiting == 2


def test_whole_run_matches_the_model_and_leaves_every_block_free(clock):
    scheduler = make_scheduler(clock)
    ids = make_requests(scheduler, 5, prompt_len=9, max_tokens=7)
    transcript = run_steps(scheduler, FakePagedWorker(4), clock)
    for seq_id in ids:
        assert transcript.token_ids(seq_id) == expected_tokens(seq_id, 9, 7)
        assert transcript.last(seq_id).finish_reason is FinishReason.LENGTH
        assert transcript.last(seq_id).num_generated == 7
        assert_contiguous(transcript, seq_id)
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


# -- preemption ----------------------------------------------------------------


def test_preempts_newest_sequence_when_blocks_run_out(clock):
    # 4 blocks of 4 tokens: two 8-token prompts fill the cache; the first decode needs a 5th block.
    scheduler = make_scheduler(clock, num_blocks=4, block_size=4, max_seq_len=16)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 1, prompt_len=8)
    clock.advance(1.0)
    make_requests(scheduler, 1, prompt_len=8, first_id=2)
    run_steps(scheduler, worker, clock, max_steps=1)
    assert scheduler.kv.num_free_blocks == 0

    plan = scheduler.schedule()
    assert plan.preempted_seq_ids == (2,)
    assert 2 in plan.finished_seq_ids
    assert [s.seq_id for s in plan.seqs] == [1]
    assert scheduler.get(2).status is SequenceStatus.PREEMPTED
    assert scheduler.get(2).num_computed_tokens == 0


def test_preempts_lowest_priority_class_before_a_newer_sequence(clock):
    scheduler = make_scheduler(clock, num_blocks=6, block_size=4, max_seq_len=24)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 1, prompt_len=8, who=tenant("bulk", Priority.SHEDDABLE))
    clock.advance(1.0)
    make_requests(scheduler, 1, prompt_len=8, first_id=2, who=tenant("app", Priority.STANDARD))
    clock.advance(1.0)
    make_requests(scheduler, 1, prompt_len=8, first_id=3, who=tenant("app", Priority.STANDARD))
    run_steps(scheduler, worker, clock, max_steps=1)

    plan = scheduler.schedule()
    assert plan.preempted_seq_ids == (1,)  # the oldest, but the only sheddable one
    assert sorted(s.seq_id for s in plan.seqs) == [2, 3]


def test_preempted_sequence_recomputes_prompt_and_generated_tokens_as_one_prefill(clock):
    # Without the prefix cache (with it, the blocks it computed before may still be resident:
    # test_step_scheduler_prefix_cache.py).
    scheduler = make_scheduler(clock, num_blocks=4, block_size=4, max_seq_len=16, enable_prefix_cache=False)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 1, prompt_len=6, max_tokens=4)
    clock.advance(1.0)
    make_requests(scheduler, 1, prompt_len=6, max_tokens=8, first_id=2)
    transcript = Transcript()
    plan = None
    for _ in range(20):
        plan = scheduler.schedule()
        transcript.plans.append(plan)
        steps = steps_by_id(plan)
        if 2 in steps and steps[2].reset_block_table and len(transcript.plans) > 1:
            break
        for delta in scheduler.update_from_output(plan, worker.run(plan)):
            transcript.deltas[delta.seq_id].append(delta)
    assert any(2 in p.preempted_seq_ids for p in transcript.plans)
    step = steps_by_id(plan)[2]
    generated = transcript.token_ids(2)
    assert step.start_position == 0 and step.sample
    assert step.token_ids == make_prompt(2, 6) + tuple(generated)
    assert step.num_generated == len(generated) > 0


def test_token_streams_with_preemption_equal_the_streams_with_enough_blocks(clock):
    def run(num_blocks: int) -> tuple[Transcript, int]:
        scheduler = make_scheduler(clock, num_blocks=num_blocks, block_size=4, max_seq_len=40)
        for i in range(6):
            make_requests(scheduler, 1, prompt_len=5 + i, max_tokens=20, first_id=i + 1)
            clock.advance(0.001)
        transcript = run_steps(scheduler, FakePagedWorker(4), clock)
        num_preempted = sum(len(p.preempted_seq_ids) for p in transcript.plans)
        assert scheduler.kv.num_free_blocks == num_blocks
        return transcript, num_preempted

    roomy, roomy_preemptions = run(num_blocks=64)
    tight, tight_preemptions = run(num_blocks=12)
    assert roomy_preemptions == 0 and tight_preemptions >= 3
    for seq_id in range(1, 7):
        assert tight.token_ids(seq_id) == roomy.token_ids(seq_id) == expected_tokens(seq_id, 4 + seq_id, 20)
        assert tight.text(seq_id) == roomy.text(seq_id)
        assert_contiguous(tight, seq_id)


def test_waiting_critical_sequence_preempts_a_running_sheddable_one(clock):
    scheduler = make_scheduler(clock, num_blocks=4, block_size=4, max_seq_len=16)
    worker = FakePagedWorker(4)
    # Two sheddable sequences hold all 4 blocks, with room left to decode in them.
    make_requests(scheduler, 2, prompt_len=6, who=tenant("bulk", Priority.SHEDDABLE))
    run_steps(scheduler, worker, clock, max_steps=1)
    make_requests(scheduler, 1, prompt_len=4, first_id=3, who=tenant("pager", Priority.CRITICAL))

    plan = scheduler.schedule()
    assert 3 in steps_by_id(plan)
    assert plan.preempted_seq_ids == (2,)


def test_standard_sequence_does_not_preempt_running_work_of_its_own_class(clock):
    scheduler = make_scheduler(clock, num_blocks=4, block_size=4, max_seq_len=16)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 2, prompt_len=6)
    run_steps(scheduler, worker, clock, max_steps=1)
    make_requests(scheduler, 1, prompt_len=4, first_id=3)
    plan = scheduler.schedule()
    assert 3 not in steps_by_id(plan)
    assert scheduler.get(3).status is SequenceStatus.WAITING


# -- stop conditions -----------------------------------------------------------


class ScriptedWorker(FakePagedWorker):
    """Samples the tokens `script` lists per sequence, in order, instead of the fake model's."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        super().__init__(block_size=4)
        self.script = {seq_id: list(tokens) for seq_id, tokens in script.items()}

    def run(self, plan):
        return {seq_id: self.script[seq_id].pop(0) for seq_id in super().run(plan)}


def test_stops_at_end_of_sequence_without_streaming_it(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 1, max_tokens=10)
    transcript = run_steps(scheduler, ScriptedWorker({1: [104, 105, EOS, 106]}), clock)
    assert transcript.token_ids(1) == [104, 105] and transcript.text(1) == "hi"
    assert transcript.last(1).finish_reason is FinishReason.EOS and transcript.last(1).end_token_id == EOS
    assert transcript.last(1).num_generated == 3


def test_a_requests_stop_token_ids_end_it_even_with_ignore_eos_and_its_text_only_when_asked(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 1, max_tokens=10, stop_token_ids=frozenset({106}), ignore_eos=True)
    make_requests(scheduler, 1, max_tokens=10, first_id=2, stop_token_ids=frozenset({106}),
                  include_stop_str_in_output=True)
    transcript = run_steps(scheduler, ScriptedWorker({1: [104, EOS, 106, 107], 2: [104, 106, 107]}), clock)
    assert transcript.token_ids(1) == [104, EOS] and transcript.last(1).finish_reason is FinishReason.EOS
    assert transcript.last(1).num_generated == 3  # counted, not streamed
    assert transcript.last(1).end_token_id == 106  # named on the last chunk (return_token_ids lists it)
    assert transcript.text(2) == "hj" and transcript.last(2).finish_reason is FinishReason.EOS


@dataclasses.dataclass(frozen=True)
class ByteTokenizerWithStops(ByteTokenizer):
    """A model whose generation_config.json lists more than one end-of-sequence id (Llama 3 Instruct)."""

    stop_token_ids: tuple[int, ...] = ()

    @property
    def end_token_ids(self) -> frozenset[int]:
        return frozenset((self.eos_token_id, *self.stop_token_ids))


EOT = 257
STOPS = ByteTokenizerWithStops(vocab_size=258, eos_token_id=EOS, stop_token_ids=(EOT,))


def test_any_of_the_models_stop_ids_ends_the_sequence_as_eos_does(clock):
    scheduler = StepScheduler(make_scheduler(clock).config, KVBlockManager(64, 4), STOPS, clock)
    make_requests(scheduler, 2, max_tokens=10)
    transcript = run_steps(scheduler, ScriptedWorker({1: [104, EOT, 105], 2: [104, 105, EOS]}), clock)
    assert transcript.token_ids(1) == [104] and transcript.last(1).finish_reason is FinishReason.EOS
    assert transcript.token_ids(2) == [104, 105] and transcript.last(2).finish_reason is FinishReason.EOS
    assert transcript.last(1).num_generated == 2  # counted, never streamed


def test_a_continuation_holding_a_stop_id_is_refused(clock):
    scheduler = StepScheduler(make_scheduler(clock).config, KVBlockManager(64, 4), STOPS, clock)
    with pytest.raises(InvalidArgument, match=r"token_ids\[1\] is the end-of-sequence id 257"):
        scheduler.add_request(1, (97, 98), SamplingParams(max_tokens=8), tenant(), deadline_s=None,
                              delivered_token_ids=(97, EOT))


def test_ignore_eos_keeps_generating_until_max_tokens(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 1, max_tokens=3, ignore_eos=True)
    transcript = run_steps(scheduler, ScriptedWorker({1: [104, EOS, 105]}), clock)
    assert transcript.token_ids(1) == [104, EOS, 105] and transcript.text(1) == "hi"
    assert transcript.last(1).finish_reason is FinishReason.LENGTH


def test_stop_string_ends_the_sequence_and_is_not_returned(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 1, max_tokens=20, stop=("##",))
    transcript = run_steps(scheduler, ScriptedWorker({1: list(b"ab#c##zz")}), clock)
    assert transcript.text(1) == "ab#c"
    assert transcript.token_ids(1) == list(b"ab#c")
    assert transcript.last(1).finish_reason is FinishReason.STOP
    assert_contiguous(transcript, 1)


# -- cancellation and deadlines -------------------------------------------------


def test_cancellation_mid_stream_frees_blocks_within_one_step(clock):
    scheduler = make_scheduler(clock)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 2, prompt_len=8, max_tokens=50)
    run_steps(scheduler, worker, clock, max_steps=3)
    held = scheduler.kv.num_used_blocks
    cancelled = scheduler.abort(1)
    assert cancelled.abort_reason is AbortReason.CANCELLED
    assert scheduler.kv.num_used_blocks < held and 1 not in scheduler.kv
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == (1,)
    assert [s.seq_id for s in plan.seqs] == [2]
    assert scheduler.abort(1) is None


def test_cancelling_while_a_step_runs_drops_its_result(clock):
    scheduler = make_scheduler(clock)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 2)
    plan = scheduler.schedule()
    sampled = worker.run(plan)
    scheduler.abort(2)
    deltas = scheduler.update_from_output(plan, sampled)
    assert [d.seq_id for d in deltas] == [1]
    assert scheduler.schedule().finished_seq_ids == (2,)


def test_deadline_expiry_in_the_queue_aborts_before_any_step(clock):
    scheduler = make_scheduler(clock, max_num_seqs=1)
    make_requests(scheduler, 1, max_tokens=50)
    make_requests(scheduler, 1, first_id=2, deadline_s=clock() + 0.5)
    run_steps(scheduler, FakePagedWorker(4), clock, max_steps=3)
    clock.advance(1.0)
    plan = scheduler.schedule()
    assert plan.expired_seq_ids == (2,)
    assert scheduler.get(2) is None
    assert 2 not in plan.finished_seq_ids  # never reached the worker


def test_deadline_expiry_in_the_running_set_frees_blocks_at_the_next_schedule(clock):
    scheduler = make_scheduler(clock)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 1, max_tokens=50, deadline_s=clock() + 0.05)
    make_requests(scheduler, 1, max_tokens=50, first_id=2)
    transcript = run_steps(scheduler, worker, clock, max_steps=4, step_s=0.02)
    assert transcript.token_ids(1)  # it was streaming
    assert any(p.expired_seq_ids == (1,) for p in transcript.plans)
    expired_at = next(i for i, p in enumerate(transcript.plans) if p.expired_seq_ids)
    assert 1 in transcript.plans[expired_at].finished_seq_ids
    assert 1 not in scheduler.kv


def test_rejects_an_already_expired_deadline_a_too_long_request_and_a_full_queue(clock):
    scheduler = make_scheduler(clock, max_seq_len=32, max_num_waiting=2)
    with pytest.raises(DeadlineExceeded):
        make_requests(scheduler, 1, deadline_s=clock())
    with pytest.raises(InvalidArgument, match=r"prompt \(30 tokens\) \+ max_tokens \(8\) = 38 exceeds"):
        make_requests(scheduler, 1, prompt_len=30)
    with pytest.raises(InvalidArgument, match="prompt must be non-empty"):
        scheduler.add_request(9, (), SamplingParams(max_tokens=1), tenant(), deadline_s=None)
    make_requests(scheduler, 2)
    with pytest.raises(ResourceExhausted, match="generate queue full") as info:
        make_requests(scheduler, 1, first_id=3)
    assert info.value.retry_after_s > 0


# -- fairness ------------------------------------------------------------------


def first_token_step(transcript: Transcript, seq_id: int) -> int:
    return next(i for i, p in enumerate(transcript.plans) if any(s.seq_id == seq_id and s.sample for s in p.seqs))


def test_heavy_tenant_barely_delays_the_light_tenants_first_token(clock):
    def light_ttft_steps(num_heavy: int) -> int:
        scheduler = make_scheduler(clock, max_num_seqs=4, max_num_batched_tokens=32, tenant_quantum_tokens=16)
        make_requests(scheduler, num_heavy, prompt_len=16, max_tokens=4, who=tenant("heavy"), first_id=100)
        make_requests(scheduler, 1, prompt_len=16, max_tokens=4, who=tenant("light"), first_id=1)
        return first_token_step(run_steps(scheduler, FakePagedWorker(4), clock), 1)

    alone = light_ttft_steps(0)
    flooded = light_ttft_steps(40)
    assert flooded <= alone + 1  # one heavy prompt goes first, then the light one


def test_weighted_tenant_is_admitted_in_proportion_to_its_weight(clock):
    scheduler = make_scheduler(clock, max_num_seqs=6, max_num_batched_tokens=48, tenant_quantum_tokens=8)
    make_requests(scheduler, 10, prompt_len=8, who=tenant("gold", weight=2), first_id=1)
    make_requests(scheduler, 10, prompt_len=8, who=tenant("basic", weight=1), first_id=100)
    plan = scheduler.schedule()
    admitted = [s.seq_id for s in plan.seqs]
    assert sum(1 for i in admitted if i < 100) == 4 and sum(1 for i in admitted if i >= 100) == 2


# -- failover and protocol -------------------------------------------------------


def test_evicted_sequences_continue_on_another_worker_without_duplicates_or_gaps(clock):
    ids = list(range(1, 5))
    reference = make_scheduler(clock)
    make_requests(reference, 4, prompt_len=7, max_tokens=12)
    expected = run_steps(reference, FakePagedWorker(4), clock)

    first = make_scheduler(clock)
    make_requests(first, 4, prompt_len=7, max_tokens=12)
    transcript = run_steps(first, FakePagedWorker(4), clock, max_steps=5)
    first.schedule()  # a step in flight when the worker dies
    survivors = first.evict_all()
    assert first.num_unfinished == 0 and first.kv.num_free_blocks == first.kv.num_blocks
    assert all(s.status is SequenceStatus.PREEMPTED and s.num_computed_tokens == 0 for s in survivors)

    second = make_scheduler(clock)
    for seq in survivors:
        second.adopt(seq)
    run_steps(second, FakePagedWorker(4), clock, transcript=transcript)
    for seq_id in ids:
        assert transcript.token_ids(seq_id) == expected.token_ids(seq_id)
        assert_contiguous(transcript, seq_id)


def test_finished_sequences_are_reported_once_in_the_next_plan(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 1, max_tokens=1)
    transcript = run_steps(scheduler, FakePagedWorker(4), clock, max_steps=1)
    assert transcript.last(1).finish_reason is FinishReason.LENGTH
    plan = scheduler.schedule()
    assert plan.finished_seq_ids == (1,) and not plan.has_work()
    assert scheduler.schedule().finished_seq_ids == ()


def test_scheduling_again_before_the_step_returns_is_refused(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 1)
    plan = scheduler.schedule()
    with pytest.raises(RuntimeError, match="still running"):
        scheduler.schedule()
    scheduler.update_from_output(plan, FakePagedWorker(4).run(plan))
    with pytest.raises(ValueError, match="not the step in flight"):
        scheduler.update_from_output(plan, {})


def test_a_sequence_the_worker_failed_is_aborted_and_reported(clock):
    scheduler = make_scheduler(clock)
    make_requests(scheduler, 3)
    plan = scheduler.schedule()
    sampled = FakePagedWorker(4).run(plan)
    del sampled[2]
    sampled[3] = 999  # outside the 257-token vocabulary
    deltas = {d.seq_id: d for d in scheduler.update_from_output(plan, sampled)}
    for seq_id in (2, 3):
        assert deltas[seq_id].abort_reason is AbortReason.FAILED and deltas[seq_id].is_last
        assert scheduler.get(seq_id) is None and seq_id not in scheduler.kv
    assert deltas[1].abort_reason is None


def test_config_must_fit_one_full_sequence_in_the_cache(clock):
    with pytest.raises(ValueError, match="max_seq_len 128 needs 32 blocks, the worker has 16"):
        make_scheduler(clock, num_blocks=16, block_size=4, max_seq_len=128)


# -- continuous batching (its static baseline: tests/unit/bench/scheduler/test_static_batching.py) and draining


def test_continuous_batching_fills_a_freed_slot_at_the_next_step(clock):
    assert first_step_of_each_sequence(clock) == {1: 0, 2: 0, 3: 2}


def test_evict_waiting_hands_over_unscheduled_and_preempted_sequences_only(clock):
    scheduler = make_scheduler(clock, max_num_seqs=2)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 4, prompt_len=4, max_tokens=8)
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, worker.run(plan))
    moved = scheduler.evict_waiting()
    assert [s.seq_id for s in moved] == [3, 4]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 0 and scheduler.num_unfinished == 2
    other = make_scheduler(clock)
    for seq in moved:
        other.adopt(seq)
    transcript = run_steps(other, FakePagedWorker(4), clock)
    for seq_id in (3, 4):
        assert transcript.token_ids(seq_id) == expected_tokens(seq_id, 4, 8)
