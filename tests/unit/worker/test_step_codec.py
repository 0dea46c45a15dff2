"""RunStep decoding: each sequence's sampling is decoded from its own message, whether or not an
equal one was decoded before (step_codec keeps the decoded ones by their wire bytes)."""

from __future__ import annotations

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.grammar_after_reasoning import GrammarAfterReasoning
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
