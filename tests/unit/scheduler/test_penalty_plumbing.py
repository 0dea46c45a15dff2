"""Penalties and logit_bias from the request to the worker: checked once at the scheduler, sent
with each sampling step, and a table reset over a cached prefix sends the prefix's tokens, so the
worker counts every token of the sequence whatever it computed itself (recompute, failover)."""

from __future__ import annotations

import dataclasses

import pytest

from infermesh.v1 import common_pb2
from services.common import errors
from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.scheduler import attach_codec
from services.scheduler.call_codec import decode_sampling
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan
from services.worker.step_codec import run_step_from_proto

from .conftest import FakePagedWorker, make_scheduler, tenant

PENALIZED = SamplingParams(max_tokens=4, temperature=0.5, presence_penalty=0.5, frequency_penalty=-0.25,
                           repetition_penalty=1.2, logit_bias=((7, -100.0), (9, 2.5)))
PROMPT = tuple(range(97, 97 + 14))  # 3 full blocks of 4, then 2 tokens


def _first_step(scheduler, worker, seq_id):
    for _ in range(100):
        plan = scheduler.schedule()
        steps = {s.seq_id: s for s in plan.seqs}
        if plan.has_work():
            scheduler.update_from_output(plan, worker.run(plan))
        if seq_id in steps:
            return steps[seq_id]
    raise AssertionError(f"sequence {seq_id} was never scheduled")


def test_a_penalized_sequence_over_a_cached_prefix_sends_the_prefix_tokens(clock):
    scheduler, worker = make_scheduler(clock, block_size=4), FakePagedWorker(4)
    scheduler.add_request(1, PROMPT, SamplingParams(max_tokens=4), tenant(), deadline_s=None)
    assert _first_step(scheduler, worker, 1).context_token_ids == ()
    scheduler.add_request(2, PROMPT, PENALIZED, tenant(), deadline_s=None)
    second = _first_step(scheduler, worker, 2)
    assert second.reset_block_table and second.start_position == 12
    assert second.context_token_ids == PROMPT[:12]
    scheduler.add_request(3, PROMPT, SamplingParams(max_tokens=4), tenant(), deadline_s=None)
    third = _first_step(scheduler, worker, 3)
    assert third.start_position == 12 and third.context_token_ids == (), "unpenalized: nothing extra sent"


def test_penalties_and_context_reach_the_worker_only_where_set(clock):
    scheduler, worker = make_scheduler(clock, block_size=4), FakePagedWorker(4)
    scheduler.add_request(1, PROMPT, PENALIZED, tenant(), deadline_s=None)
    _first_step(scheduler, worker, 1)
    scheduler.add_request(2, PROMPT, PENALIZED, tenant(), deadline_s=None)
    step = _first_step(scheduler, worker, 2)
    stream = GenerateStream(seq_id=2, tenant=TenantContext("t"), seed=5, trace_context={}, arrival_s=0.0,
                            deadline_s=None)
    sent = attach_codec.encode_run_step(StepPlan(1, (step,), ()), {2: stream}).seqs[0]
    assert list(sent.context_token_ids) == list(PROMPT[:12])
    assert (sent.sampling.presence_penalty, sent.sampling.frequency_penalty) == (0.5, -0.25)
    assert sent.sampling.repetition_penalty == pytest.approx(1.2)
    assert dict(sent.sampling.logit_bias) == {7: -100.0, 9: 2.5}


def test_decoded_sampling_carries_the_penalties() -> None:
    sampling = decode_sampling(common_pb2.SamplingParams(presence_penalty=1.0, frequency_penalty=2.0,
                                                         logit_bias={5: 1.0, 3: -2.0}), 8, vocab_size=10)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (1.0, 2.0, 1.0)
    assert sampling.logit_bias == ((3, -2.0), (5, 1.0)) and sampling.penalized


@pytest.mark.parametrize(("sampling", "message"), [
    (common_pb2.SamplingParams(presence_penalty=2.5), r"sampling.presence_penalty must be in \[-2, 2\], got 2.5"),
    (common_pb2.SamplingParams(frequency_penalty=float("inf")), r"sampling.frequency_penalty must be in \[-2, 2\]"),
    (common_pb2.SamplingParams(repetition_penalty=-1), r"sampling.repetition_penalty must be in \(0, 2\]"),
    (common_pb2.SamplingParams(logit_bias={10: 1.0}), r"sampling.logit_bias: token id 10 is not a token of this "
                                                      r"model \(ids 0..9\)"),
    (common_pb2.SamplingParams(logit_bias={-1: 1.0}), "sampling.logit_bias: token id -1 is not a token"),
    (common_pb2.SamplingParams(logit_bias={2: 100.5}), r"sampling.logit_bias\[2\] must be in \[-100, 100\]"),
    (common_pb2.SamplingParams(logit_bias={i: 1.0 for i in range(1025)}), "holds 1025 entries; at most 1024"),
])
def test_bad_penalties_are_invalid_argument_naming_the_field(sampling, message) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        decode_sampling(sampling, 4, vocab_size=2000 if len(sampling.logit_bias) > 1000 else 10)


def test_a_structured_output_is_compiled_once_and_travels_with_every_step(clock):
    sampling = decode_sampling(common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(regex="[a-c]{2}")), 4)
    assert sampling.grammar and sampling.needs_history and not sampling.penalized
    scheduler, worker = make_scheduler(clock, block_size=4), FakePagedWorker(4)
    scheduler.add_request(1, PROMPT, SamplingParams(max_tokens=4), tenant(), deadline_s=None)
    _first_step(scheduler, worker, 1)
    scheduler.add_request(2, PROMPT, dataclasses.replace(sampling, max_tokens=4), tenant(), deadline_s=None)
    step = _first_step(scheduler, worker, 2)
    assert step.context_token_ids == PROMPT[:12], "the worker's matcher needs the sequence's tokens"
    stream = GenerateStream(seq_id=2, tenant=TenantContext("t"), seed=5, trace_context={}, arrival_s=0.0,
                            deadline_s=None)
    assert attach_codec.encode_run_step(StepPlan(1, (step,), ()), {2: stream}).seqs[0].grammar == sampling.grammar


@pytest.mark.parametrize("after", [
    None,  # the grammar holds the whole output: nothing sent, as from every older scheduler
    GrammarAfterReasoning(0),  # id 0 is an id like any: the message's presence says the grammar waits
    GrammarAfterReasoning(422, start_token_id=0),
])
def test_where_a_grammar_starts_after_the_reasoning_reaches_the_worker_with_every_step(after) -> None:
    sampling = dataclasses.replace(decode_sampling(common_pb2.SamplingParams(
        structured=common_pb2.StructuredOutput(regex="[a-c]{2}")), 4), grammar_after_reasoning=after)
    stream = GenerateStream(seq_id=2, tenant=TenantContext("t"), seed=5, trace_context={}, arrival_s=0.0,
                            deadline_s=None)
    for step in (SequenceStep(2, PROMPT, 0, (0, 1, 2, 3), True, True, sampling, 0),
                 SequenceStep(2, (7,), len(PROMPT) + 3, (), False, True, sampling, 4)):
        sent = attach_codec.encode_run_step(StepPlan(1, (step,), ()), {2: stream})
        assert sent.seqs[0].HasField("grammar_after_reasoning") == (after is not None)
        assert run_step_from_proto(sent).seqs[0].sampling.grammar_after_reasoning == after


@pytest.mark.parametrize(("structured", "message"), [
    (common_pb2.StructuredOutput(json_schema='{"type": "nope"}'), "sampling.structured: invalid json_schema"),
    (common_pb2.StructuredOutput(json_schema="[1]"), "sampling.structured: json_schema must be a JSON object"),
    (common_pb2.StructuredOutput(json_schema="{"), "sampling.structured: json_schema is not JSON"),
    (common_pb2.StructuredOutput(regex="(a"), "sampling.structured: invalid regex"),
    (common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["a", ""])),
     "sampling.structured: choice needs 1 to 256 non-empty strings"),
    (common_pb2.StructuredOutput(grammar="start: rule"),
     'sampling.structured: invalid grammar: .*unknown name: "rule"'),
    (common_pb2.StructuredOutput(grammar='root ::= ( "a" '),
     "sampling.structured: invalid grammar: Failed to convert the grammar from GBNF to Lark: Expected"),
    (common_pb2.StructuredOutput(grammar=""), "sampling.structured: invalid grammar: .*No 'root' rule found"),
    (common_pb2.StructuredOutput(),
     "sampling.structured: set one of json_schema, json_object, regex, choice, grammar"),
])
def test_a_bad_structured_output_is_invalid_argument_naming_the_problem(structured, message) -> None:
    with pytest.raises(errors.InvalidArgument, match=message.replace("(", r"\(")):
        decode_sampling(common_pb2.SamplingParams(structured=structured), 4)


def test_structured_output_refuses_ignore_eos() -> None:
    with pytest.raises(errors.InvalidArgument, match="sampling.ignore_eos cannot be combined with sampling.structured"):
        decode_sampling(common_pb2.SamplingParams(ignore_eos=True,
                                                  structured=common_pb2.StructuredOutput(regex="a")), 4)


def test_top_k_and_min_p_are_decoded_checked_and_sent_to_the_worker_only_when_set(clock):
    cut = decode_sampling(common_pb2.SamplingParams(temperature=0.7, top_k=5, min_p=0.05), 4)
    assert (cut.top_k, cut.min_p) == (5, pytest.approx(0.05)) and not cut.needs_history
    scheduler, worker = make_scheduler(clock, block_size=4), FakePagedWorker(4)
    scheduler.add_request(1, PROMPT, cut, tenant(), deadline_s=None)
    scheduler.add_request(2, PROMPT, SamplingParams(max_tokens=4, temperature=0.7), tenant(), deadline_s=None)
    steps = {n: _first_step(scheduler, worker, n) for n in (1, 2)}
    streams = {n: GenerateStream(seq_id=n, tenant=TenantContext("t"), seed=5, trace_context={}, arrival_s=0.0,
                                 deadline_s=None) for n in (1, 2)}
    sent = {n: attach_codec.encode_run_step(StepPlan(1, (steps[n],), ()), streams).seqs[0] for n in (1, 2)}
    assert (sent[1].sampling.top_k, sent[1].sampling.min_p) == (5, pytest.approx(0.05))
    assert (sent[2].sampling.top_k, sent[2].sampling.min_p) == (0, 0.0)
    decoded = run_step_from_proto(  # the worker's side of the same message
        attach_codec.encode_run_step(StepPlan(1, (steps[1],), ()), streams)).seqs[0]
    assert (decoded.sampling.top_k, decoded.sampling.min_p) == (5, pytest.approx(0.05))


@pytest.mark.parametrize(("sampling", "message"), [
    (common_pb2.SamplingParams(top_k=1_000_001), r"sampling.top_k must be at most 1000000 \(0: off\), got 1000001"),
    (common_pb2.SamplingParams(min_p=1.5), r"sampling.min_p must be in \[0, 1\] \(0: off\), got 1.5"),
    (common_pb2.SamplingParams(min_p=-0.1), r"sampling.min_p must be in \[0, 1\]"),
    (common_pb2.SamplingParams(min_p=float("nan")), r"sampling.min_p must be in \[0, 1\] \(0: off\), got nan"),
])
def test_bad_top_k_or_min_p_is_invalid_argument_naming_the_field(sampling, message) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        decode_sampling(sampling, 4)


# -- vLLM's min_tokens --------------------------------------------------------------------------------


def test_min_tokens_bans_the_models_end_ids_until_enough_were_generated() -> None:
    sampling = decode_sampling(common_pb2.SamplingParams(min_tokens=2), 4, end_token_ids=frozenset({7, 3}))
    assert (sampling.min_tokens, sampling.min_tokens_ban) == (2, (3, 7))
    assert decode_sampling(common_pb2.SamplingParams(min_tokens=2, ignore_eos=True), 4, end_token_ids={3}).min_tokens_ban == ()
    assert decode_sampling(common_pb2.SamplingParams(), 4, end_token_ids={3}).min_tokens_ban == ()
    streams = {1: GenerateStream(seq_id=1, tenant=TenantContext("t"), seed=5, trace_context={}, arrival_s=0.0,
                                 deadline_s=None)}

    def sent(num_generated: int, sample: bool = True):
        step = SequenceStep(seq_id=1, token_ids=(97,), start_position=4 + num_generated, new_blocks=(),
                            reset_block_table=False, sample=sample, sampling=sampling, num_generated=num_generated)
        return attach_codec.encode_run_step(StepPlan(1, (step,), ()), streams)

    assert [list(sent(n).seqs[0].banned_token_ids) for n in (0, 1, 2, 3)] == [[3, 7], [3, 7], [], []]
    assert list(sent(0, sample=False).seqs[0].banned_token_ids) == []  # a prompt chunk draws nothing
    assert run_step_from_proto(sent(1)).seqs[0].banned_token_ids == (3, 7)  # the worker's side


@pytest.mark.parametrize(("sampling", "max_tokens", "message"), [
    (common_pb2.SamplingParams(min_tokens=5, max_tokens=4), 4, r"sampling.min_tokens \(5\) must be at most max_tokens \(4\)"),
    (common_pb2.SamplingParams(min_tokens=200), 128,
     r"sampling.min_tokens \(200\) must be at most the default max_tokens \(128\)"),
])
def test_min_tokens_past_max_tokens_is_invalid_argument(sampling, max_tokens, message) -> None:
    with pytest.raises(errors.InvalidArgument, match=message):
        decode_sampling(sampling, max_tokens)


def test_stop_token_ids_are_checked_and_min_tokens_holds_them_off_with_ignore_eos_too() -> None:
    sampling = decode_sampling(common_pb2.SamplingParams(stop_token_ids=[9, 5], min_tokens=1, ignore_eos=True), 4,
                               vocab_size=16, end_token_ids={3})
    assert (sampling.stop_token_ids, sampling.min_tokens_ban) == (frozenset({5, 9}), (5, 9))
    both = decode_sampling(common_pb2.SamplingParams(stop_token_ids=[9], min_tokens=1), 4, 16, end_token_ids={3})
    assert both.min_tokens_ban == (3, 9)
    with pytest.raises(errors.InvalidArgument, match=r"sampling.stop_token_ids\[1\] is 16, but the model's token ids"):
        decode_sampling(common_pb2.SamplingParams(stop_token_ids=[1, 16]), 4, vocab_size=16)
    with pytest.raises(errors.InvalidArgument, match="sampling.stop_token_ids holds 65 ids; at most 64"):
        decode_sampling(common_pb2.SamplingParams(stop_token_ids=range(65)), 4)
