"""A grammar that waits for a reasoning model's think block (SequenceStep.grammar_after_reasoning), at
the worker over tinylm's real logits: tokens up to the block's end sampled without a mask, the
grammar's from the next on (complete: only the end), the block's opening allowed beside the grammar
at the first token where the output may open one, and the same tokens after a recompute or through
pipelined steps, since where the grammar starts is read from the output tokens alone."""

from __future__ import annotations

import dataclasses
import re

import pytest

from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.scheduler.structured_output import compile_grammar
from services.worker.repository.loader import LoadedModel
from services.worker.step_masks import StepMasker
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceOutput, SequenceStep

from .test_grammar import EOS, _with_grammar
from .test_step_executor import PROMPT, _sample_run

# Bytes stand in for the think tags: the worker knows them by id only.
START, END = ord("<"), ord(">")
Q = ord("Q")  # a token the grammar never allows, pushed up by logit_bias
YES_NO = compile_grammar("choice", ["yes", "no"])
OPENED = GrammarAfterReasoning(END)
MAY_OPEN = GrammarAfterReasoning(END, start_token_id=START)


def _params(after: GrammarAfterReasoning | None, pushed: int = Q, **over) -> SamplingParams:
    return SamplingParams(grammar=YES_NO, grammar_after_reasoning=after, logit_bias=((pushed, 40.0),), **over)


def _next(executor, params: SamplingParams, output: bytes | list[int]) -> SequenceOutput:
    """What the sequence samples after PROMPT + output, computed afresh (a reset table: a recompute,
    or the first step on another worker)."""
    tokens = (*PROMPT, *output)
    blocks = tuple(range(-(-len(tokens) // 8)))
    outputs, _ = executor.run(RunStep(0, (SequenceStep(1, tokens, 0, blocks, True, sample=True, sampling=params,
                                                       num_generated=len(output)),), finished_seq_ids=(1,)))
    assert outputs[0].error is None, outputs[0].error
    return outputs[0]


def test_the_output_samples_freely_until_the_end_of_the_block_then_under_the_grammar(tinylm: LoadedModel):
    executor, params = _with_grammar(tinylm), _params(OPENED)
    assert _next(executor, params, b"").token_id == Q  # thinking: nothing masked
    assert _next(executor, params, b"QQ").token_id == Q
    assert _next(executor, params, b"Q>").token_id in (ord("y"), ord("n"))  # the grammar's first token
    assert _next(executor, params, b"Q>n").token_id == ord("o")
    assert _next(executor, params, b"Q>no").token_id == EOS  # complete: only the end, as before
    # A grammar that does not wait holds the first token, as before.
    assert _next(executor, _params(None), b"").token_id in (ord("y"), ord("n"))


def test_the_end_of_sequence_may_come_while_thinking(tinylm: LoadedModel):
    assert _next(_with_grammar(tinylm), _params(OPENED, pushed=EOS), b"Q").token_id == EOS


def test_an_output_that_may_open_a_block_takes_its_opening_or_the_grammars_first_token(tinylm: LoadedModel):
    executor = _with_grammar(tinylm)
    assert _next(executor, _params(MAY_OPEN, pushed=START), b"").token_id == START
    first = _next(executor, _params(MAY_OPEN, logprobs=True, top_logprobs=5), b"")
    assert first.logprobs is not None
    assert {t.token_id for t in first.logprobs.top} == {START, ord("y"), ord("n")}  # Q is masked
    assert _next(executor, _params(MAY_OPEN), b"<QQ").token_id == Q  # it opened one: free until the end
    assert _next(executor, _params(MAY_OPEN), b"<Q>").token_id in (ord("y"), ord("n"))
    assert _next(executor, _params(MAY_OPEN), b"y").token_id == ord("e")  # it did not: the grammar's from the first
    assert _next(executor, _params(MAY_OPEN, pushed=START), b"ye").token_id == ord("s")


def test_a_sequence_still_thinking_starts_no_mask_job(tinylm: LoadedModel, monkeypatch):
    jobs: list[int] = []
    start = StepMasker.start
    monkeypatch.setattr(StepMasker, "start", lambda self, batch: jobs.append(len(batch)) or start(self, batch))
    executor = _with_grammar(tinylm)
    _next(executor, _params(OPENED), b"QQ")
    assert jobs == []
    _next(executor, _params(OPENED), b"Q>")
    assert jobs == [1]


REGEX = "[a-z]{3}-[0-9]{2}"
SPACE = GrammarAfterReasoning(ord(" "))  # tinylm writes spaces often: its "reasoning" ends at the first


@pytest.mark.parametrize("seed", range(3))
def test_a_recomputed_sequence_samples_what_the_straight_run_samples(tinylm: LoadedModel, seed: int):
    params = SamplingParams(temperature=1.0, seed=seed, grammar=compile_grammar("regex", REGEX),
                            grammar_after_reasoning=SPACE)
    # The straight run's length first (its grammar ends it: a step past the end has nothing to sample).
    probe = [_next(_with_grammar(tinylm), params, b"").token_id]
    while probe[-1] != EOS and len(probe) < 40:
        probe.append(_next(_with_grammar(tinylm), params, probe).token_id)
    thought = probe.index(ord(" ")) + 1
    assert 1 < thought < 10, bytes(probe)  # the model thought for a few tokens first
    assert re.fullmatch(REGEX, bytes(probe[thought:-1]).decode()) and probe[-1] == EOS
    for preempt_after in (None, 1, thought - 1, thought, thought + 2):  # thinking, at its end, under the grammar
        assert _sample_run(_with_grammar(tinylm), params, len(probe), preempt_after) == probe


def test_pipelined_steps_sample_what_steps_one_at_a_time_sample(tinylm: LoadedModel):
    params = SamplingParams(temperature=1.0, seed=1, grammar=compile_grammar("regex", REGEX),
                            grammar_after_reasoning=SPACE)

    def run(pipelined: bool) -> list[int]:
        executor = _with_grammar(tinylm)
        blocks = tuple(range(-(-len(PROMPT) // 8)))
        outputs, _ = executor.run(RunStep(0, (SequenceStep(1, PROMPT, 0, blocks, True, sample=True, sampling=params),)))
        tokens = [outputs[0].token_id]
        while tokens[-1] != EOS:
            position = len(PROMPT) + len(tokens) - 1
            new = (position // 8,) if position % 8 == 0 else ()
            step = SequenceStep(1, () if pipelined else (tokens[-1],), position, new, sample=True, sampling=params,
                                num_generated=len(tokens), input_from_last_sample=pipelined)
            outputs, _ = executor.run(RunStep(len(tokens), (step,)))
            assert outputs[0].error is None, outputs[0].error
            tokens.append(outputs[0].token_id)
        return tokens

    assert run(pipelined=True) == run(pipelined=False)


@pytest.mark.parametrize(("sampling", "problem"), [
    (_params(GrammarAfterReasoning(258)), "token ids in [0, 258), got [258]"),
    (_params(GrammarAfterReasoning(END, start_token_id=-1)), f"got [{END}, -1]"),
    (dataclasses.replace(_params(OPENED), grammar=""), "grammar_after_reasoning needs a grammar"),
])
def test_a_bad_grammar_start_fails_its_sequence_alone(tinylm: LoadedModel, sampling, problem):
    outputs, _ = _with_grammar(tinylm).run(RunStep(0, (
        SequenceStep(1, PROMPT, 0, (0, 1, 2, 3), True, sample=True, sampling=sampling),
        SequenceStep(2, PROMPT, 0, (4, 5, 6, 7), True, sample=True, sampling=_params(OPENED)),
    )))
    assert outputs[0].error is not None and outputs[0].error.code == ErrorCode.INVALID_ARGUMENT
    assert problem in outputs[0].error.message
    assert outputs[1].error is None and outputs[1].token_id == Q
