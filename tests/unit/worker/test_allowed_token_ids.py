"""vLLM's allowed_token_ids at the worker: every other token's logit is -inf before logit_bias, the
penalties, the bans and the draw; a grammar that allows none of them fails the sequence naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from services.scheduler.structured_output import compile_grammar
from services.worker.repository.loader import LoadedModel
from services.worker.sampling import check_sampling, only_allowed, sample
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceStep

from .test_grammar import _with_grammar
from .test_step_executor import PROMPT, _executor


def test_only_the_allowed_ids_keep_their_logits() -> None:
    logits = np.array([3.0, 1.0, 2.0, 0.5], dtype=np.float32)
    kept = only_allowed(logits, (1, 3))
    assert kept is not None
    assert kept.tolist() == [-math.inf, 1.0, -math.inf, 0.5] and logits[0] == 3.0  # the caller's row is untouched
    assert only_allowed(np.array([-math.inf, 1.0, -math.inf]), (0, 2)) is None  # nothing finite is left


def test_greedy_picks_the_best_allowed_and_a_draw_only_allowed_ones() -> None:
    logits = np.array([9.0, 1.0, 2.0, 0.5, 8.0])
    kept = only_allowed(logits, (1, 2, 3))
    assert kept is not None
    assert sample(kept, SamplingParams(), seed=1, index=0).token_id == 2
    drawn = {sample(kept, SamplingParams(temperature=1.0, seed=s), seed=s, index=i).token_id
             for s in range(20) for i in range(10)}
    assert drawn <= {1, 2, 3} and len(drawn) > 1
    reported = sample(kept, SamplingParams(logprobs=True, top_logprobs=5), seed=1, index=0).logprobs
    assert reported is not None and {t.token_id for t in reported.top} == {1, 2, 3}  # masked ids are not offered


def test_more_than_4096_allowed_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids holds 4097 ids; at most 4096"):
        check_sampling(SamplingParams(allowed_token_ids=tuple(range(4097))))


def _ranked(tinylm: LoadedModel) -> list[int]:
    return tinylm.generator.dense_logits(PROMPT)[-1].argsort(descending=True).tolist()


def test_greedy_step_draws_the_most_likely_allowed_id_even_against_logit_bias(tinylm: LoadedModel) -> None:
    ranked = _ranked(tinylm)
    # The 2nd and the 20th most likely: far apart, so the choice does not hang on float noise.
    params = SamplingParams(allowed_token_ids=tuple(sorted((ranked[1], ranked[19]))),
                            logit_bias=((ranked[0], 100.0),))
    outputs, _ = _executor(tinylm).run(RunStep(0, (SequenceStep(5, PROMPT, 0, (3, 9, 4, 0), True, sample=True,
                                                                sampling=params),)))
    assert outputs[0].error is None and outputs[0].token_id == ranked[1]


def test_a_ban_of_every_allowed_id_gives_way_as_min_tokens_bans_do(tinylm: LoadedModel) -> None:
    ranked = _ranked(tinylm)
    params = SamplingParams(allowed_token_ids=(ranked[1],))
    outputs, _ = _executor(tinylm).run(RunStep(0, (SequenceStep(5, PROMPT, 0, (3, 9, 4, 0), True, sample=True,
                                                                sampling=params, banned_token_ids=(ranked[1],)),)))
    assert outputs[0].token_id == ranked[1]  # the caller's list holds; the ban would leave nothing


def test_allowed_ids_outside_the_vocabulary_fail_the_sequence_alone(tinylm: LoadedModel) -> None:
    params = SamplingParams(allowed_token_ids=(4, 300))
    outputs, _ = _executor(tinylm).run(RunStep(0, (SequenceStep(5, PROMPT, 0, (3, 9, 4, 0), True, sample=True,
                                                                sampling=params),)))
    assert outputs[0].error is not None and outputs[0].error.code == ErrorCode.INVALID_ARGUMENT
    assert "allowed token ids [300] outside [0, 258)" in outputs[0].error.message


def test_a_grammar_that_allows_none_of_them_fails_the_sequence_naming_the_field(tinylm: LoadedModel) -> None:
    grammar = compile_grammar("choice", ["yes", "no"])
    free = SequenceStep(0, PROMPT, 0, (0, 1, 2, 3), True, sample=True,
                        sampling=SamplingParams(grammar=grammar, allowed_token_ids=(ord("n"), ord("x"))))
    clash = SequenceStep(1, PROMPT, 0, (4, 5, 6, 7), True, sample=True,
                         sampling=SamplingParams(grammar=grammar, allowed_token_ids=(ord("a"), ord("b"))))
    outputs, _ = _with_grammar(tinylm).run(RunStep(0, (free, clash)))
    assert outputs[0].error is None and outputs[0].token_id == ord("n")  # the one both allow
    assert outputs[1].error is not None and outputs[1].error.code == ErrorCode.INVALID_ARGUMENT
    assert outputs[1].error.message.startswith("sampling.allowed_token_ids: the grammar")
