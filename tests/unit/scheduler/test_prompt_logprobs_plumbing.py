"""Prompt logprobs through the scheduler: prompt chunks ask the worker for them (with the token after
the chunk), the reports are filed by position, the stream's first chunk carries them all once (None
first), a request asking reads nothing from the prefix cache, a continuation sends none, and the
fields travel on the wire both ways."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common import errors
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.scheduler import attach_codec
from services.scheduler.call_codec import decode_sampling
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan

from .conftest import FakePagedWorker, make_scheduler, tenant

PROMPT = tuple(range(60, 100))  # 40 tokens: two chunks under a 32-token budget


def _entry(token_id: int) -> PositionLogprobs:
    """A made-up report whose value names its token, so a misfiled one shows."""
    return PositionLogprobs(TokenLogprob(token_id, -token_id / 100), (TokenLogprob(1, -0.5),))


def _reports(plan: StepPlan) -> dict[int, tuple[PositionLogprobs, ...]]:
    """What a worker reports for the plan's prompt chunks: an entry per token each predicts."""
    reports = {}
    for step in plan.seqs:
        if step.prompt_logprobs is not None:
            targets = step.token_ids[1:] + ((step.next_prompt_token_id,) if step.next_prompt_token_id is not None
                                            else ())
            reports[step.seq_id] = tuple(_entry(t) for t in targets)
    return reports


def _run(scheduler, worker: FakePagedWorker, num_steps: int = 20) -> tuple[list, list]:
    plans, deltas = [], []
    for _ in range(num_steps):
        plan = scheduler.schedule()
        if not plan.has_work():
            break
        plans.append(plan)
        deltas += scheduler.update_from_output(plan, worker.run(plan), None, None, _reports(plan))
    return plans, deltas


def test_prompt_chunks_ask_for_them_and_the_first_chunk_carries_every_one_once(clock) -> None:
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, PROMPT, SamplingParams(max_tokens=3, prompt_logprobs=2), tenant(), deadline_s=None)
    plans, deltas = _run(scheduler, FakePagedWorker(4))
    first, second = plans[0].seqs[0], plans[1].seqs[0]
    assert (first.prompt_logprobs, first.next_prompt_token_id, len(first.token_ids)) == (2, PROMPT[32], 32)
    assert (second.prompt_logprobs, second.next_prompt_token_id) == (2, None)
    assert all(s.prompt_logprobs is None for p in plans[2:] for s in p.seqs)  # decodes
    assert deltas[0].prompt_token_ids == PROMPT
    assert deltas[0].prompt_logprobs == (None, *(_entry(t) for t in PROMPT[1:]))
    assert all(d.prompt_logprobs == () and d.prompt_token_ids == () for d in deltas[1:])


def test_without_prompt_logprobs_no_step_asks_and_no_chunk_carries_them(clock) -> None:
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, PROMPT, SamplingParams(max_tokens=2), tenant(), deadline_s=None)
    plans, deltas = _run(scheduler, FakePagedWorker(4))
    assert all(s.prompt_logprobs is None for p in plans for s in p.seqs)
    assert all(d.prompt_logprobs == () for d in deltas)


def test_a_request_asking_for_them_reads_nothing_from_the_prefix_cache_but_fills_it(clock) -> None:
    scheduler = make_scheduler(clock, enable_prefix_cache=True)
    worker = FakePagedWorker(4)
    scheduler.add_request(1, PROMPT, SamplingParams(max_tokens=1), tenant(), deadline_s=None)
    _run(scheduler, worker)
    scheduler.add_request(2, PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=0), tenant(), deadline_s=None)
    plans, deltas = _run(scheduler, worker)
    assert plans[0].seqs[0].start_position == 0 and plans[0].seqs[0].num_cached_tokens == 0
    assert None not in deltas[0].prompt_logprobs[1:]
    scheduler.add_request(3, PROMPT, SamplingParams(max_tokens=1), tenant(), deadline_s=None)
    plans, _ = _run(scheduler, worker)
    assert plans[0].seqs[0].num_cached_tokens > 0  # what request 2 computed is reused by others


def test_a_continuation_sends_no_prompt_logprobs_its_first_stream_sent_them(clock) -> None:
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, PROMPT[:8], SamplingParams(max_tokens=4, prompt_logprobs=1), tenant(), deadline_s=None,
                          delivered_token_ids=(101, 102))
    plans, deltas = _run(scheduler, FakePagedWorker(4))
    assert all(s.prompt_logprobs is None for p in plans for s in p.seqs)
    assert deltas and all(d.prompt_logprobs == () for d in deltas)


def test_prompt_logprobs_travel_to_the_worker_and_back() -> None:
    sampling = SamplingParams(max_tokens=4, prompt_logprobs=3)
    plan = StepPlan(step_id=1, finished_seq_ids=(), seqs=(
        SequenceStep(seq_id=1, token_ids=(5, 6), start_position=0, new_blocks=(0,), reset_block_table=True,
                     sample=False, sampling=sampling, num_generated=0, prompt_logprobs=3, next_prompt_token_id=7),))
    stream = GenerateStream(seq_id=1, tenant=TenantContext("t"), seed=7, trace_context={}, arrival_s=0.0,
                            deadline_s=None)
    sent = attach_codec.encode_run_step(plan, {1: stream}).seqs[0]
    assert (sent.prompt_logprobs, sent.next_prompt_token_id) == (3, 7)
    result = scheduler_pb2.StepResult(step_id=1, outputs=[scheduler_pb2.SequenceOutput(
        seq_id=1, prompt_logprobs=[common_pb2.PositionLogprobs(token=common_pb2.TokenLogprob(token_id=6, logprob=-2.0),
                                                               top=[common_pb2.TokenLogprob(token_id=9, logprob=-1.0)])])])
    outcome = attach_codec.decode_step_result(result)
    assert outcome.prompt_logprobs == {1: (PositionLogprobs(TokenLogprob(6, -2.0), (TokenLogprob(9, -1.0),)),)}


def test_decode_sampling_reads_prompt_logprobs_and_refuses_more_than_twenty() -> None:
    assert decode_sampling(common_pb2.SamplingParams(), 4).prompt_logprobs is None
    assert decode_sampling(common_pb2.SamplingParams(prompt_logprobs=0), 4).prompt_logprobs == 0
    with pytest.raises(errors.InvalidArgument, match="sampling.prompt_logprobs must be at most 20, got 21"):
        decode_sampling(common_pb2.SamplingParams(prompt_logprobs=21), 4)
