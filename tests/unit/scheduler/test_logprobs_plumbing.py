"""Logprobs from the worker's step result to the stream's chunks: in lockstep with the token ids a
chunk carries (stop strings, coalescing and continuations included), and on the wire both ways."""

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

from .conftest import make_scheduler, tenant


def _logprobs_for(token_id: int) -> PositionLogprobs:
    """A made-up report whose values name their token, so a misaligned one shows."""
    return PositionLogprobs(TokenLogprob(token_id, -token_id / 100), (TokenLogprob(token_id + 1, -0.01),))


def _run(scheduler, seq_id: int, tokens: list[int]) -> list:
    deltas = []
    for token in tokens:
        plan = scheduler.schedule()
        if not plan.seqs:
            break
        deltas += scheduler.update_from_output(plan, {seq_id: token}, None, {seq_id: _logprobs_for(token)})
    return deltas


def test_chunks_carry_one_logprobs_entry_per_token_even_when_a_stop_string_holds_text_back(clock):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, (97, 98), SamplingParams(max_tokens=20, stop=("#!",), logprobs=True, top_logprobs=1),
                          tenant(), deadline_s=None)
    deltas = _run(scheduler, 1, list(b"ab#c#!zz"))
    for delta in deltas:
        assert [p.token.token_id for p in delta.logprobs] == list(delta.token_ids)
        assert delta.logprobs == tuple(_logprobs_for(t) for t in delta.token_ids)
    assert [t for d in deltas for t in d.token_ids] == list(b"ab#c")


def test_a_continuation_reports_logprobs_of_the_tokens_it_generates_only(clock):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, (97, 98), SamplingParams(max_tokens=6, logprobs=True), tenant(), deadline_s=None,
                          delivered_token_ids=(99, 100))
    deltas = _run(scheduler, 1, [101, 102, 103, 104])
    assert deltas[0].index == 2
    assert [p.token.token_id for d in deltas for p in d.logprobs] == [101, 102, 103, 104]


def test_without_logprobs_chunks_carry_none(clock):
    scheduler = make_scheduler(clock)
    scheduler.add_request(1, (97,), SamplingParams(max_tokens=2), tenant(), deadline_s=None)
    assert all(d.logprobs == () for d in _run(scheduler, 1, [104, 105]))


def test_logprobs_travel_to_the_worker_and_back() -> None:
    sampling = SamplingParams(max_tokens=4, temperature=0.5, logprobs=True, top_logprobs=3)
    plan = StepPlan(step_id=1, finished_seq_ids=(), seqs=(
        SequenceStep(seq_id=1, token_ids=(5,), start_position=3, new_blocks=(), reset_block_table=False,
                     sample=True, sampling=sampling, num_generated=1),))
    stream = GenerateStream(seq_id=1, tenant=TenantContext("t"), seed=7, trace_context={}, arrival_s=0.0,
                            deadline_s=None)
    command = attach_codec.encode_run_step(plan, {1: stream})
    assert (command.seqs[0].sampling.logprobs, command.seqs[0].sampling.top_logprobs) == (True, 3)
    result = scheduler_pb2.StepResult(step_id=1, outputs=[scheduler_pb2.SequenceOutput(
        seq_id=1, token_id=42, logprobs=common_pb2.PositionLogprobs(
            token=common_pb2.TokenLogprob(token_id=42, logprob=-0.5),
            top=[common_pb2.TokenLogprob(token_id=7, logprob=-0.25)]))])
    outcome = attach_codec.decode_step_result(result)
    assert outcome.logprobs == {1: PositionLogprobs(TokenLogprob(42, -0.5), (TokenLogprob(7, -0.25),))}


@pytest.mark.parametrize(("sampling", "message"), [
    (common_pb2.SamplingParams(logprobs=True, top_logprobs=21), "sampling.top_logprobs must be at most 20, got 21"),
    (common_pb2.SamplingParams(top_logprobs=2), "sampling.top_logprobs needs sampling.logprobs"),
])
def test_bad_logprobs_requests_are_invalid_argument(sampling, message) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        decode_sampling(sampling, 4)
