from __future__ import annotations

import dataclasses
import itertools

import pytest

from services.worker.repository.loader import LoadedModel
from services.worker.step_executor import StepExecutor
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceStep

BOS = 257
PROMPT = (BOS, *b"The value of a variable ")


def _executor(tinylm: LoadedModel, num_kv_blocks: int = 32, block_size: int = 8) -> StepExecutor:
    ticks = itertools.count()
    return StepExecutor(tinylm.generator, num_kv_blocks, block_size, clock=lambda: float(next(ticks)),
                        seed_source=lambda: 99)


def _blocks_for(num_tokens: int, have: int, pool: list[int], block_size: int = 8) -> tuple[int, ...]:
    return tuple(pool.pop() for _ in range(-(-num_tokens // block_size) - have))


def _sample_run(executor: StepExecutor, params: SamplingParams, num_new: int, preempt_after: int | None,
                chunk: int = 8) -> list[int]:
    """Generates num_new tokens; after preempt_after tokens the sequence is dropped and recomputed in chunks."""
    pool = list(range(executor.num_kv_blocks))
    tokens = list(PROMPT)
    blocks = _blocks_for(len(tokens), 0, pool)
    step_id = itertools.count()
    outputs, _ = executor.run(RunStep(next(step_id), (SequenceStep(
        1, tuple(tokens), 0, blocks, reset_block_table=True, sample=True, sampling=params),)))
    generated = [outputs[0].token_id]
    num_blocks = len(blocks)
    while len(generated) < num_new:
        tokens = [*PROMPT, *generated]
        if len(generated) == preempt_after:
            # Preempted: the scheduler frees the blocks, then recomputes prompt + generated into new ones.
            pool = list(reversed(range(executor.num_kv_blocks)))
            executor.run(RunStep(next(step_id), (), finished_seq_ids=(1,)))
            num_blocks = 0
            for start in range(0, len(tokens), chunk):
                end = min(start + chunk, len(tokens))
                new = _blocks_for(end, num_blocks, pool)
                num_blocks += len(new)
                last = end == len(tokens)
                outputs, _ = executor.run(RunStep(next(step_id), (SequenceStep(
                    1, tuple(tokens[start:end]), start, new, reset_block_table=start == 0, sample=last,
                    sampling=params, num_generated=len(generated)),)))
            generated.append(outputs[0].token_id)
            continue
        new = _blocks_for(len(tokens), num_blocks, pool)
        num_blocks += len(new)
        outputs, _ = executor.run(RunStep(next(step_id), (SequenceStep(
            1, (tokens[-1],), len(tokens) - 1, new, sample=True, sampling=params, num_generated=len(generated)),)))
        assert outputs[0].error is None, outputs[0].error
        generated.append(outputs[0].token_id)
    return generated


def test_seeded_sampling_is_reproduced_after_preemption_and_recompute(tinylm: LoadedModel) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    straight = _sample_run(_executor(tinylm), params, num_new=20, preempt_after=None)
    preempted = _sample_run(_executor(tinylm), params, num_new=20, preempt_after=9)
    assert preempted == straight


def test_penalized_seeded_sampling_is_reproduced_after_preemption_and_recompute(tinylm: LoadedModel) -> None:
    params = SamplingParams(temperature=0.9, seed=77, presence_penalty=1.0, frequency_penalty=0.5,
                            repetition_penalty=1.3, logit_bias=((ord("e"), -5.0),))
    straight = _sample_run(_executor(tinylm), params, num_new=20, preempt_after=None)
    preempted = _sample_run(_executor(tinylm), params, num_new=20, preempt_after=9)
    assert preempted == straight
    assert straight != _sample_run(_executor(tinylm), dataclasses.replace(params, frequency_penalty=0.0,
                                                                           presence_penalty=0.0), 20, None)


def test_a_penalized_table_over_a_cached_prefix_needs_the_prefix_tokens(tinylm: LoadedModel) -> None:
    executor = _executor(tinylm)
    params = SamplingParams(repetition_penalty=1.5, logprobs=True)
    executor.run(RunStep(0, (SequenceStep(1, PROMPT[:16], 0, (0, 1), True, sampling=params),)))
    without, with_context = (SequenceStep(2, PROMPT[16:], 16, (0, 1, 2, 3), True, sample=True, sampling=params,
                                          num_cached_tokens=16, context_token_ids=context)
                             for context in ((), PROMPT[:16]))
    outputs, _ = executor.run(RunStep(1, (without,)))
    assert outputs[0].error is not None and "needs the 16 tokens before start_position" in outputs[0].error.message
    outputs, _ = executor.run(RunStep(2, (with_context,)))
    straight, _ = _executor(tinylm).run(RunStep(0, (SequenceStep(3, PROMPT, 0, (0, 1, 2, 3), True, sample=True,
                                                                 sampling=params),)))
    # The greedy pick of the same penalized logits (by its logprob: a near tie may flip on another CPU).
    assert outputs[0].error is None and outputs[0].logprobs is not None and straight[0].logprobs is not None
    assert outputs[0].logprobs.token.logprob == pytest.approx(straight[0].logprobs.token.logprob, abs=1e-4)


def test_different_seeds_sample_different_tokens(tinylm: LoadedModel) -> None:
    first = _sample_run(_executor(tinylm), SamplingParams(temperature=1.0, seed=1), num_new=24, preempt_after=None)
    second = _sample_run(_executor(tinylm), SamplingParams(temperature=1.0, seed=2), num_new=24, preempt_after=None)
    assert first != second


def test_greedy_step_returns_argmax_with_logprob(tinylm: LoadedModel) -> None:
    executor = _executor(tinylm)
    outputs, durations = executor.run(RunStep(0, (SequenceStep(5, PROMPT, 0, (3, 9, 4, 0), True, sample=True),)))
    dense = tinylm.generator.dense_logits(PROMPT)[-1]
    assert outputs[0].token_id == int(dense.argmax())
    assert outputs[0].logprob == pytest.approx(float(dense.log_softmax(-1).max()), abs=1e-4)
    assert (durations.compute_s, durations.postprocess_s) == (1.0, 1.0)  # one fake-clock tick each


def test_banned_ids_are_not_drawn(tinylm: LoadedModel) -> None:
    top_two = tinylm.generator.dense_logits(PROMPT)[-1].topk(2).indices.tolist()
    outputs, _ = _executor(tinylm).run(RunStep(0, (SequenceStep(5, PROMPT, 0, (3, 9, 4, 0), True, sample=True,
                                                                banned_token_ids=(top_two[0],)),)))
    assert outputs[0].token_id == top_two[1]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_log_softmax_of_the_models_logits_over_temperature(tinylm: LoadedModel,
                                                                       temperature: float) -> None:
    executor = _executor(tinylm)
    params = SamplingParams(temperature=temperature, seed=5, logprobs=True, top_logprobs=3)
    outputs, _ = executor.run(RunStep(0, (SequenceStep(5, PROMPT, 0, (3, 9, 4, 0), True, sample=True,
                                                       sampling=params),)))
    reference = (tinylm.generator.dense_logits(PROMPT)[-1].double() / (temperature or 1.0)).log_softmax(-1)
    logprobs = outputs[0].logprobs
    assert logprobs is not None and logprobs.token.token_id == outputs[0].token_id
    assert logprobs.token.logprob == pytest.approx(float(reference[outputs[0].token_id]), abs=1e-4)
    # Compared by value, not by id order: a near tie may order differently on another CPU.
    assert [t.logprob for t in logprobs.top] == pytest.approx(reference.topk(3).values.tolist(), abs=1e-4)
    assert [t.logprob for t in logprobs.top] == pytest.approx([float(reference[t.token_id]) for t in logprobs.top],
                                                              abs=1e-4)


def test_bad_sequences_fail_alone_with_invalid_argument(tinylm: LoadedModel) -> None:
    executor = _executor(tinylm, num_kv_blocks=32)
    good = SequenceStep(1, PROMPT, 0, (0, 1, 2, 3), True, sample=True)
    max_seq_len = tinylm.generator.max_seq_len
    bad = [
        (SequenceStep(2, (1, 2), 0, (32,), True, sample=True), "block ids [32] outside the worker's 32 blocks"),
        (SequenceStep(3, (300,), 0, (4,), True, sample=True), "token ids [300] outside [0, 258)"),
        (SequenceStep(4, (1, 2, 3), 0, (), True, sample=True), "block table of 0 blocks holds 0 positions"),
        (SequenceStep(5, (1,), 4, (5,), sample=True), "start_position 4 but only 0 positions are cached"),
        (SequenceStep(6, (1,), max_seq_len, (6,), True, sample=True), f"outside [0, max_seq_len {max_seq_len})"),
        (SequenceStep(7, (1,), 0, (7,), True, sample=True, sampling=SamplingParams(temperature=-1.0)),
         "temperature must be a finite number >= 0"),
        (SequenceStep(8, (), 0, (8,), True), "no token_ids"),
        (SequenceStep(9, (1,), 0, (10,), True, sample=True, banned_token_ids=(4, 300)),
         "banned token ids [300] outside [0, 258)"),
        (SequenceStep(1, (1,), 0, (9,), True, sample=True), "sequence 1 appears twice"),
    ]
    outputs, _ = executor.run(RunStep(0, (good, *(s for s, _ in bad))))
    assert outputs[0].error is None and outputs[0].token_id is not None
    assert outputs[0].token_id == int(tinylm.generator.dense_logits(PROMPT)[-1].argmax())
    for out, (seq, fragment) in zip(outputs[1:], bad, strict=True):
        assert out.seq_id == seq.seq_id and out.token_id is None
        assert out.error is not None and out.error.code == ErrorCode.INVALID_ARGUMENT
        assert fragment in out.error.message
    assert executor.num_sequences == 1 and executor.block_table(1) == (0, 1, 2, 3)  # failed ones are forgotten


def test_block_tables_grow_reset_and_are_forgotten(tinylm: LoadedModel) -> None:
    executor = _executor(tinylm)
    executor.run(RunStep(0, (SequenceStep(1, PROMPT[:8], 0, (5,), True),)))  # a non-final prefill chunk
    outputs, _ = executor.run(RunStep(1, (SequenceStep(1, PROMPT[8:], 8, (2, 9, 4), sample=True),)))
    assert outputs[0].token_id is not None
    assert executor.block_table(1) == (5, 2, 9, 4)
    assert executor.num_kv_blocks_used == 4
    executor.run(RunStep(2, (SequenceStep(1, PROMPT[:3], 0, (7,), reset_block_table=True),)))
    assert executor.block_table(1) == (7,)
    executor.run(RunStep(3, (), finished_seq_ids=(1,)))
    assert executor.num_sequences == 0 and executor.num_kv_blocks_used == 0


def test_non_sampling_chunk_reports_no_token(tinylm: LoadedModel) -> None:
    executor = _executor(tinylm)
    outputs, _ = executor.run(RunStep(0, (SequenceStep(1, PROMPT[:8], 0, (5,), True, sample=False),)))
    assert outputs[0].error is None and outputs[0].token_id is None and outputs[0].logprob is None


def test_a_sequence_reusing_another_ones_prefix_pages_samples_what_a_full_prefill_samples(tinylm: LoadedModel) -> None:
    # PROMPT is 25 tokens: three full blocks of 8, then one token.
    executor = _executor(tinylm)
    outputs, _ = executor.run(RunStep(0, (SequenceStep(1, PROMPT, 0, (3, 9, 4, 0), True, sample=True),)))
    executor.run(RunStep(1, (), finished_seq_ids=(1,)))  # finished: the pages stay as they are
    other = (*PROMPT[:24], *b"ABCDE")
    reused = SequenceStep(2, other[16:], 16, (3, 9, 5, 6), True, sample=True, num_cached_tokens=16)
    again = SequenceStep(3, PROMPT[24:], 24, (3, 9, 4, 7), True, sample=True, num_cached_tokens=24)
    outputs, _ = executor.run(RunStep(2, (reused, again)))
    assert [o.error for o in outputs] == [None, None]
    assert outputs[0].token_id == int(tinylm.generator.dense_logits(other)[-1].argmax())
    assert outputs[1].token_id == int(tinylm.generator.dense_logits(PROMPT)[-1].argmax())
    assert executor.block_table(2) == (3, 9, 5, 6) and executor.num_kv_blocks_used == 6


def test_cached_positions_must_fit_the_new_table_and_come_with_a_reset(tinylm: LoadedModel) -> None:
    executor = _executor(tinylm)
    executor.run(RunStep(0, (SequenceStep(1, PROMPT[:8], 0, (5,), True),)))
    bad = [
        (SequenceStep(2, (1,), 16, (1, 2), True, num_cached_tokens=17),
         "num_cached_tokens 17 but the new block table of 2 blocks holds 16 positions"),
        (SequenceStep(1, PROMPT[8:], 8, (2, 9, 4), num_cached_tokens=8), "num_cached_tokens 8 without reset_block_table"),
        (SequenceStep(3, (1,), 9, (6, 7), True, num_cached_tokens=8), "start_position 9 but only 8 positions are cached"),
    ]
    outputs, _ = executor.run(RunStep(1, tuple(s for s, _ in bad)))
    for out, (_, fragment) in zip(outputs, bad, strict=True):
        assert out.error is not None and out.error.code == ErrorCode.INVALID_ARGUMENT
        assert fragment in out.error.message
    assert executor.num_sequences == 0
