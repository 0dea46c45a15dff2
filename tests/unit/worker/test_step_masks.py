"""The step's grammar masks off the critical path (services/worker/step_masks.py): computed on the mask
thread while the forward runs, they allow exactly what the serial path (Guide.allowed after the
forward, then the -inf fill row by row) allows, so the sampled tokens are the same; a failing
grammar still fails its sequence alone."""

from __future__ import annotations

import dataclasses
import json
import threading

import numpy as np
import pytest

from services.scheduler.structured_output import compile_grammar
from services.worker.grammar import GrammarError, Guide
from services.worker.repository.loader import LoadedModel
from services.worker.sampling import processed_logits, sample
from services.worker.step_masks import MaskJob, StepMasker, mask_logits
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceStep

from .test_grammar import BYTES, EOS, SCHEMA, _with_grammar
from .test_step_executor import PROMPT

GRAMMARS = {
    "choice": compile_grammar("choice", ["yes", "no", "maybe"]),
    "regex": compile_grammar("regex", "[a-z]{2,5}-[0-9]{2}"),
    "json_schema": compile_grammar("json_schema", json.dumps(SCHEMA)),
    "lark": compile_grammar("grammar", 'start: answer " " DIGIT\nanswer: "yes" | "no"\nDIGIT: /[0-9]/'),
}
OUTPUTS = {  # an output each grammar takes, walked prefix by prefix
    "choice": b"maybe",
    "regex": b"abcd-42",
    "json_schema": b'{"ok": true, "n": 22}',
    "lark": b"no 7",
}


def _allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    logits = np.zeros((1, vocab_size), dtype=np.float32)
    mask_logits(logits, [0], row[None, :])
    return np.isfinite(logits[0])


def test_the_mask_thread_allows_what_the_serial_path_allows_for_every_grammar_and_prefix():
    masker = StepMasker(BYTES)
    guides: dict[str, Guide | None] = dict.fromkeys(GRAMMARS)
    for length in range(max(map(len, OUTPUTS.values())) + 1):
        names = [n for n in GRAMMARS if length <= len(OUTPUTS[n])]
        jobs = [MaskJob(GRAMMARS[n], guides[n], list(OUTPUTS[n][guides[n].num_consumed if guides[n] else 0 : length]))
                for n in names]
        masks = masker.start(jobs).result(timeout=30)
        assert masks.errors == (None,) * len(names)
        for name, row, guide in zip(names, masks.bitmask, masks.guides, strict=True):
            serial = Guide(BYTES, GRAMMARS[name]).allowed(list(OUTPUTS[name][:length]))
            assert np.array_equal(_allowed(row, BYTES.vocab_size), serial), (name, length)
            guides[name] = guide
    masker.close()
    assert set(Guide(BYTES, GRAMMARS["lark"]).allowed(list(OUTPUTS["lark"])).nonzero()[0]) == {EOS}


@pytest.mark.parametrize("rows", [[4, 0, 2], [1, 2, 3]])  # scattered rows, and a block of them
def test_the_vectorised_fill_equals_the_row_by_row_fill(rows: list[int]):
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((5, BYTES.vocab_size)).astype(np.float32)
    masker = StepMasker(BYTES)
    jobs = [MaskJob(GRAMMARS[n], None, list(OUTPUTS[n][:k])) for n, k in (("regex", 3), ("choice", 0), ("lark", 3))]
    masks = masker.compute(jobs)
    expected = logits.copy()
    for (name, k), row in zip((("regex", 3), ("choice", 0), ("lark", 3)), rows, strict=True):
        expected[row][~Guide(BYTES, GRAMMARS[name]).allowed(list(OUTPUTS[name][:k]))] = -np.inf
    mask_logits(logits, rows, masks.bitmask)
    assert np.array_equal(logits, expected)


def test_ids_past_the_tokenizers_vocabulary_are_never_allowed():
    logits = np.zeros((1, BYTES.vocab_size + 40), dtype=np.float32)
    mask_logits(logits, [0], StepMasker(BYTES).compute([MaskJob(GRAMMARS["json_schema"], None, [])]).bitmask)
    assert np.isneginf(logits[0, BYTES.vocab_size:]).all()


class _RecordingGenerator:
    """The model's generator, keeping a copy of every step's logits before the executor masks them."""

    def __init__(self, generator, before_forward=None) -> None:
        self._generator = generator
        self._before_forward = before_forward
        self.logits: list[np.ndarray] = []

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def step(self, seqs, cache):
        if self._before_forward is not None:
            self._before_forward()
        logits = self._generator.step(seqs, cache)
        self.logits.append(logits.numpy().copy())
        return logits


PARAMS = [
    SamplingParams(grammar=GRAMMARS["choice"], logprobs=True, top_logprobs=3),
    SamplingParams(grammar=GRAMMARS["regex"], repetition_penalty=1.3, logit_bias=((ord("z"), 5.0),)),
    SamplingParams(logprobs=True, top_logprobs=2),  # unconstrained, in the same steps
    SamplingParams(grammar=GRAMMARS["json_schema"], logprobs=True, top_logprobs=3),
    SamplingParams(grammar=GRAMMARS["lark"], presence_penalty=1.0, frequency_penalty=0.5),
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_overlapped_steps_sample_what_the_serial_path_samples(tinylm: LoadedModel, temperature: float):
    """Greedy (and seeded): each step's tokens and logprobs equal the serial path's over the same logits:
    processed_logits, then Guide.allowed's -inf fill, then sample, one sequence after another."""
    executor = _with_grammar(tinylm)
    recorder = _RecordingGenerator(tinylm.generator)
    executor.generator = recorder  # type: ignore[assignment]
    params = [dataclasses.replace(p, temperature=temperature, seed=11 + i) for i, p in enumerate(PARAMS)]
    serial_guides = [Guide(BYTES, p.grammar) if p.grammar else None for p in params]
    tokens = [list(PROMPT) for _ in params]
    generated: list[list[int]] = [[] for _ in params]
    live = list(range(len(params)))
    for step_id in range(40):
        seqs = []
        for i in live:
            # Six blocks of 8 each (prompt and 16 tokens), all given with the prompt.
            first = not generated[i]
            chunk = tuple(tokens[i]) if first else (tokens[i][-1],)
            seqs.append(SequenceStep(i, chunk, len(tokens[i]) - len(chunk), tuple(range(6 * i, 6 * i + 6)) if first else (),
                                     reset_block_table=first, sample=True, sampling=params[i],
                                     num_generated=len(generated[i])))
        outputs, _ = executor.run(RunStep(step_id, tuple(seqs)))
        raw = recorder.logits[-1]
        for row, (i, out) in enumerate(zip(live, outputs, strict=True)):
            assert out.error is None, out.error
            expected_row = processed_logits(raw[row], params[i], tokens[i], len(generated[i]))
            guide = serial_guides[i]
            if guide is not None:
                expected_row[~guide.allowed(generated[i])] = -np.inf
            expected = sample(expected_row, params[i], seed=11 + i, index=len(generated[i]))
            assert (out.token_id, out.logprob, out.logprobs) == (expected.token_id, expected.logprob, expected.logprobs)
            generated[i].append(out.token_id)
            tokens[i].append(out.token_id)
        live = [i for i in live if generated[i][-1] != EOS and len(generated[i]) < 16]
        if not live:
            break
    assert all(generated[i][-1] == EOS for i, p in enumerate(params) if p.grammar in (GRAMMARS["choice"],
                                                                                      GRAMMARS["lark"]))


def test_masks_are_computed_while_the_forward_runs(tinylm: LoadedModel, monkeypatch):
    """The forward waits until a mask is being computed: a serial path (masks after the forward) would
    never get there and the step would fail."""
    computing = threading.Event()
    fill_mask = Guide.fill_mask

    def noted_fill_mask(self, row):
        computing.set()
        fill_mask(self, row)

    monkeypatch.setattr(Guide, "fill_mask", noted_fill_mask)

    def forward_waits():
        if not computing.wait(timeout=30):
            raise AssertionError("no mask was computed while the forward ran")

    executor = _with_grammar(tinylm)
    executor.generator = _RecordingGenerator(tinylm.generator, forward_waits)  # type: ignore[assignment]
    step = SequenceStep(1, PROMPT, 0, (0, 1, 2, 3), True, sample=True, sampling=SamplingParams(grammar=GRAMMARS["choice"]))
    outputs, _ = executor.run(RunStep(0, (step,)))
    assert outputs[0].error is None and outputs[0].token_id in (ord("y"), ord("n"), ord("m"))


def test_a_grammar_that_fails_on_the_mask_thread_fails_its_sequence_alone(tinylm: LoadedModel):
    executor = _with_grammar(tinylm)
    grammars = ["start: ( unknown", GRAMMARS["choice"], "", GRAMMARS["regex"]]
    seqs = tuple(SequenceStep(i, PROMPT, 0, tuple(range(4 * i, 4 * i + 4)), True, sample=True,
                              sampling=SamplingParams(grammar=g)) for i, g in enumerate(grammars))
    outputs, _ = executor.run(RunStep(0, seqs))
    assert outputs[0].error is not None and outputs[0].error.code == ErrorCode.INVALID_ARGUMENT
    assert "the grammar does not load" in outputs[0].error.message
    assert [o.error for o in outputs[1:]] == [None, None, None]
    assert outputs[1].token_id in (ord("y"), ord("n"), ord("m")) and chr(outputs[3].token_id).islower()
    # The next step feeds the choice an output token it cannot take ("x", standing in for the sampled
    # one): that sequence fails alone; the regex sequence goes on.
    left = SequenceStep(1, (ord("x"),), len(PROMPT), (), sample=True, sampling=SamplingParams(grammar=GRAMMARS["choice"]),
                        num_generated=1)
    right = SequenceStep(3, (outputs[3].token_id,), len(PROMPT), (), sample=True,
                         sampling=SamplingParams(grammar=GRAMMARS["regex"]), num_generated=1)
    outputs, _ = executor.run(RunStep(1, (left, right)))
    assert outputs[0].error is not None and "the output left the grammar" in outputs[0].error.message
    assert outputs[1].error is None and chr(outputs[1].token_id).islower()


def test_masks_land_on_each_sequences_sample_row_beside_prompt_logprobs_and_a_mid_prompt_chunk(tinylm: LoadedModel):
    """Rows of a step: a mid-prompt chunk with prompt logprobs (8 rows, no sample), an unconstrained
    sequence (1 row), a constrained one with prompt logprobs (8 rows, its sample the last). The
    masks hit only the constrained sample rows: the prompt logprobs and the free sequence's token are
    those of the same step without any grammar."""
    choice = SamplingParams(grammar=GRAMMARS["choice"])

    def step(grammar_params: SamplingParams):
        return RunStep(0, (
            SequenceStep(1, PROMPT[:8], 0, (0,), True, prompt_logprobs=2, next_prompt_token_id=PROMPT[8]),
            SequenceStep(2, PROMPT, 0, (4, 5, 6, 7), True, sample=True),
            SequenceStep(3, PROMPT[:8], 0, (8,), True, sample=True, sampling=grammar_params, prompt_logprobs=2),
        ))

    constrained, _ = _with_grammar(tinylm).run(step(choice))
    free, _ = _with_grammar(tinylm).run(step(SamplingParams()))
    assert [o.error for o in constrained] == [None, None, None]
    assert constrained[2].token_id in (ord("y"), ord("n"), ord("m"))
    assert constrained[0].prompt_logprobs == free[0].prompt_logprobs and len(free[0].prompt_logprobs) == 8
    assert constrained[2].prompt_logprobs == free[2].prompt_logprobs and len(free[2].prompt_logprobs) == 7
    assert constrained[1].token_id == free[1].token_id


@pytest.mark.parametrize("endless", ['root ::= "a" root', 'start: "a" start'])
def test_a_grammar_forcing_an_endless_sequence_fails_its_sequence_alone_as_the_callers(tinylm: LoadedModel,
                                                                                         endless: str):
    """llguidance hits its item limit following the forced "a"s (after the first output token): that
    sequence fails with a short message naming the structured output (the caller's, so a 400 upstream),
    without llguidance's state dump; a sequence beside it goes on."""
    executor = _with_grammar(tinylm)
    grammar = compile_grammar("grammar", endless)
    first = SequenceStep(1, PROMPT, 0, (0, 1, 2, 3), True, sample=True, sampling=SamplingParams(grammar=grammar))
    outputs, _ = executor.run(RunStep(0, (first,)))
    assert outputs[0].error is None and outputs[0].token_id == ord("a")
    endless_step = SequenceStep(1, (ord("a"),), len(PROMPT), (), sample=True,
                                sampling=SamplingParams(grammar=grammar), num_generated=1)
    beside = SequenceStep(2, PROMPT, 0, (4, 5, 6, 7), True, sample=True,
                          sampling=SamplingParams(grammar=GRAMMARS["choice"]))
    outputs, _ = executor.run(RunStep(1, (endless_step, beside)))
    error = outputs[0].error
    assert error is not None and error.code == ErrorCode.INVALID_ARGUMENT
    assert error.message.startswith("sampling.structured: ") and "Too many items" in error.message
    assert "<state>" not in error.message and "\n" not in error.message
    assert outputs[1].error is None and outputs[1].token_id in (ord("y"), ord("n"), ord("m"))


def test_an_output_that_left_the_grammar_is_not_reported_as_the_callers():
    """A token the mask did not allow is the worker's fault, not the caller's: no sampling.structured
    prefix (the scheduler reports it as internal), and no state dump either."""
    guide = Guide(BYTES, compile_grammar("choice", ["yes"]))
    with pytest.raises(GrammarError) as caught:
        guide.advance([ord("x")])
    assert not caught.value.callers and "<state>" not in str(caught.value)
