"""RunStep decoding: each sequence's sampling is decoded from its own message, whether or not an
equal one was decoded before (step_codec keeps the decoded ones by their wire bytes)."""

from __future__ import annotations

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.worker import step_codec, work


def _step(seq_id: int, **sampling) -> scheduler_pb2.SequenceStep:
    return scheduler_pb2.SequenceStep(seq_id=seq_id, token_ids=[7], start_position=3, sample=True,
                                      sampling=common_pb2.SamplingParams(**sampling))


def test_each_sequence_gets_the_sampling_it_was_sent_across_steps() -> None:
    first = step_codec.run_step_from_proto(scheduler_pb2.RunStep(step_id=1, seqs=[
        _step(1, seed=11, temperature=0.5), _step(2, seed=12, top_p=0.75), _step(3)]))
    assert [s.sampling for s in first.seqs] == [
        work.SamplingParams(temperature=0.5, seed=11), work.SamplingParams(top_p=0.75, seed=12), work.SamplingParams()]
    again = step_codec.run_step_from_proto(scheduler_pb2.RunStep(step_id=2, seqs=[
        _step(2, seed=12, top_p=0.75), _step(1, seed=11, temperature=0.5, logit_bias={5: 2.0, 3: -1.0})]))
    assert again.seqs[0].sampling == first.seqs[1].sampling
    assert again.seqs[1].sampling == work.SamplingParams(temperature=0.5, seed=11, logit_bias=((3, -1.0), (5, 2.0)))


def test_a_grammar_step_is_decoded_with_its_grammar() -> None:
    step = _step(1, seed=3)
    step.grammar = "start: /a+/"
    step.grammar_after_reasoning.end_token_id = 9
    (seq,) = step_codec.run_step_from_proto(scheduler_pb2.RunStep(seqs=[step])).seqs
    assert seq.sampling == work.SamplingParams(seed=3, grammar="start: /a+/",
                                               grammar_after_reasoning=GrammarAfterReasoning(9, None))
    (plain,) = step_codec.run_step_from_proto(scheduler_pb2.RunStep(seqs=[_step(1, seed=3)])).seqs
    assert plain.sampling == work.SamplingParams(seed=3)


def test_the_kept_samplings_are_bounded() -> None:
    for seed in range(step_codec._SAMPLING_CACHE_SIZE + 10):
        (seq,) = step_codec.run_step_from_proto(scheduler_pb2.RunStep(seqs=[_step(1, seed=seed)])).seqs
        assert seq.sampling.seed == seed
    assert len(step_codec._SAMPLING_CACHE) <= step_codec._SAMPLING_CACHE_SIZE


def test_step_results_carry_each_outputs_fields_and_drop_compute_only_ones() -> None:
    position = PositionLogprobs(TokenLogprob(5, -0.5), (TokenLogprob(5, -0.5), TokenLogprob(6, -1.5)))
    outputs = [
        work.SequenceOutput(1, token_id=5, logprob=-0.5),
        work.SequenceOutput(2),  # computed a prompt chunk: nothing to send
        work.SequenceOutput(3, token_id=0, logprob=None, logprobs=position),
        work.SequenceOutput(4, error=work.ItemError(work.ErrorCode.INVALID_ARGUMENT, "bad token")),
        work.SequenceOutput(5, prompt_logprobs=(position, position)),
        work.SequenceOutput(6, embedding=(0.25, -1.0)),
    ]
    timings = common_pb2.Timings(total_us=1234)
    result = step_codec.step_result_to_proto(9, outputs, timings)
    assert result.step_id == 9 and result.timings == timings
    assert [o.seq_id for o in result.outputs] == [1, 3, 4, 5, 6]
    first, greedy_zero, failed, prompt, embedded = result.outputs
    assert (first.token_id, first.logprob, first.HasField("error"), first.HasField("logprobs")) == (5, -0.5, False, False)
    assert greedy_zero.token_id == 0 and greedy_zero.logprobs.token.token_id == 5
    assert [t.token_id for t in greedy_zero.logprobs.top] == [5, 6]
    assert (failed.error.code, failed.error.message) == (3, "bad token")
    assert len(prompt.prompt_logprobs) == 2 and prompt.prompt_logprobs[1].top[1].logprob == -1.5
    assert list(embedded.embedding) == [0.25, -1.0] and not embedded.HasField("error")
