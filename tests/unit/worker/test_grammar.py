"""Constrained sampling at the worker: the grammar's mask over tinylm's real logits, outputs that
always match, the same tokens after preemption and recompute, a bad grammar failing its sequence alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.scheduler.structured_output import compile_grammar
from services.worker.grammar import GrammarTokenizer, Guide
from services.worker.repository.loader import LoadedModel
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceStep

from .test_step_executor import PROMPT, _executor, _sample_run

BYTES = GrammarTokenizer.from_bytes(vocab_size=258, eos_token_id=256, bos_token_id=257)
EOS = 256


def _with_grammar(tinylm: LoadedModel, **over):
    executor = _executor(tinylm)
    executor.grammar_tokenizer = GrammarTokenizer.from_bytes(tinylm.generator.vocab_size, EOS, 257)
    return executor


def test_a_choice_grammar_allows_its_strings_then_only_the_end():
    guide = Guide(BYTES, compile_grammar("choice", ["yes", "no"]))
    assert set(guide.allowed([]).nonzero()[0]) == {ord("y"), ord("n")}
    assert set(guide.allowed(list(b"ye")).nonzero()[0]) == {ord("s")}
    assert set(guide.allowed(list(b"yes")).nonzero()[0]) == {EOS}


@pytest.mark.parametrize("grammar", [
    'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]',  # GBNF / EBNF, as xgrammar reads it
    'start: answer " " DIGIT\nanswer: "yes" | "no"\nDIGIT: /[0-9]/',  # Lark, as llguidance reads it
])
def test_a_grammar_in_either_form_allows_its_language_then_only_the_end(grammar):
    guide = Guide(BYTES, compile_grammar("grammar", grammar))
    assert set(guide.allowed([]).nonzero()[0]) == {ord("y"), ord("n")}
    assert set(guide.allowed(list(b"no ")).nonzero()[0]) == set(b"0123456789")
    assert set(guide.allowed(list(b"no 7")).nonzero()[0]) == {EOS}


@pytest.mark.parametrize("seed", range(6))
def test_sampled_outputs_match_the_regex_and_repeat_after_preemption(tinylm: LoadedModel, seed: int):
    params = SamplingParams(temperature=1.0, seed=seed, grammar=compile_grammar("regex", "[a-z]{3}-[0-9]{2}"))
    straight = _sample_run(_with_grammar(tinylm), params, num_new=7, preempt_after=None)
    assert re.fullmatch("[a-z]{3}-[0-9]{2}", bytes(straight[:6]).decode()) and straight[6] == EOS
    assert _sample_run(_with_grammar(tinylm), params, num_new=7, preempt_after=4) == straight


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]}},
          "required": ["ok", "n"], "additionalProperties": False}


def _until_end(executor, params: SamplingParams, max_tokens: int = 80) -> list[int]:
    """Generates one sequence (block size 8, one block at a time) until end-of-sequence or max_tokens."""
    tokens, generated = list(PROMPT), []
    blocks = list(range(-(-len(tokens) // 8)))
    outputs, _ = executor.run(RunStep(0, (SequenceStep(1, tuple(tokens), 0, tuple(blocks), True, sample=True,
                                                       sampling=params),)))
    for step_id in range(1, max_tokens + 1):
        assert outputs[0].error is None, outputs[0].error
        generated.append(outputs[0].token_id)
        if generated[-1] == EOS:
            break
        tokens.append(generated[-1])
        new = (len(blocks),) if len(tokens) > 8 * len(blocks) else ()
        blocks += new
        outputs, _ = executor.run(RunStep(step_id, (SequenceStep(1, (tokens[-1],), len(tokens) - 1, new, sample=True,
                                                                 sampling=params, num_generated=len(generated)),)))
    return generated


@pytest.mark.parametrize("seed", range(4))
def test_sampled_json_validates_against_its_schema(tinylm: LoadedModel, seed: int):
    params = SamplingParams(temperature=1.0, seed=seed, grammar=compile_grammar("json_schema", json.dumps(SCHEMA)))
    generated = _until_end(_with_grammar(tinylm), params)
    assert generated[-1] == EOS
    jsonschema.validate(json.loads(bytes(generated[:-1]).decode()), SCHEMA)


def test_masked_tokens_are_never_among_the_top_logprobs(tinylm: LoadedModel):
    params = SamplingParams(grammar=compile_grammar("choice", ["yes", "no"]), logprobs=True, top_logprobs=5)
    outputs, _ = _with_grammar(tinylm).run(RunStep(0, (SequenceStep(1, PROMPT, 0, (0, 1, 2, 3), True, sample=True,
                                                                     sampling=params),)))
    assert outputs[0].token_id in (ord("y"), ord("n")) and outputs[0].logprobs is not None
    assert {t.token_id for t in outputs[0].logprobs.top} <= {ord("y"), ord("n")}


def test_a_grammar_on_a_worker_without_a_tokenizer_fails_its_sequence_alone(tinylm: LoadedModel):
    params = SamplingParams(grammar=compile_grammar("choice", ["yes"]))
    free, constrained = (SequenceStep(i, PROMPT, 0, (4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3), True, sample=True,
                                      sampling=s) for i, s in ((0, SamplingParams()), (1, params)))
    outputs, _ = _executor(tinylm).run(RunStep(0, (free, constrained)))
    assert outputs[0].error is None and outputs[0].token_id is not None
    assert outputs[1].error is not None and outputs[1].error.code == ErrorCode.INVALID_ARGUMENT
    assert "no tokenizer to constrain its output" in outputs[1].error.message
