"""A Llama-family model served the way the worker serves tinylm: wrapped in a `Generator` and driven by
the `StepExecutor` with Attach-shaped steps (block tables grown by new_blocks, chunked prefill beside
decodes, greedy sampling). Its tokens equal transformers' generate on the same weights."""

from __future__ import annotations

import itertools
import random

import pytest

from services.worker.models.generator import Generator
from services.worker.models.llama_weights import load_llama_family
from services.worker.step_executor import StepExecutor
from services.worker.work import RunStep, SequenceStep
from tests.unit.worker.models.test_llama_family import GREEDY_MIN_MARGIN, random_ids, transformers_greedy


def generator_of(ckpt) -> Generator:
    return Generator(load_llama_family(ckpt.directory), max_seq_len=256, eos_token_id=2, bos_token_id=1)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_generator_greedy_paged_dense_and_batched_equal_transformers(tiny_checkpoints, family):
    ckpt = tiny_checkpoints[family]
    generator = generator_of(ckpt)
    prompts = [random_ids(n, seed=200 + n) for n in (3, 17, 30)]
    expected, margin = transformers_greedy(ckpt.reference, prompts, 24)
    assert margin >= GREEDY_MIN_MARGIN, f"a near-tie in the reference ({margin:.1e}): choose other seeds"
    for prompt, tokens in zip(prompts, expected, strict=True):
        assert generator.greedy_paged(prompt, 24, block_size=4, prefill_chunk=5) == tokens
        assert generator.greedy_dense(prompt, 24) == tokens
    # all prompts in the same steps (the golden check's path), each to its own length
    lengths = [24, 9, 1]
    assert generator.greedy_paged_batch(prompts, lengths, block_size=4, prefill_chunk=5) == [
        tokens[:n] for tokens, n in zip(expected, lengths, strict=True)]
    assert generator.vocab_size == 512 and generator.new_kv_cache(8, 4).block_size == 4


def executor_greedy(executor: StepExecutor, prompts: list[list[int]], num_new_tokens: int, *,
                    prefill_chunk: int) -> list[list[int]]:
    """What the scheduler sends a worker: each step, every unfinished sequence's next prompt chunk or its
    last sampled token, with the blocks its table needs appended."""
    block_size = executor.block_size
    free = random.Random(2).sample(range(executor.num_kv_blocks), executor.num_kv_blocks)
    ids = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    num_blocks = [0] * len(prompts)
    for step_id in itertools.count():
        running = [i for i, p in enumerate(prompts) if len(ids[i]) < len(p) + num_new_tokens]
        if not running:
            return [seq[len(p):] for seq, p in zip(ids, prompts, strict=True)]
        seqs = []
        for i in running:
            new = tuple(ids[i][computed[i]:computed[i] + prefill_chunk])
            end = computed[i] + len(new)
            grown = -(-end // block_size) - num_blocks[i]
            blocks = tuple(free.pop() for _ in range(grown))
            seqs.append(SequenceStep(i, new, computed[i], blocks, reset_block_table=computed[i] == 0,
                                     sample=end == len(ids[i]), num_generated=len(ids[i]) - len(prompts[i])))
            num_blocks[i] += grown
            computed[i] = end
        outputs, _ = executor.run(RunStep(step_id, tuple(seqs)))
        for seq, out in zip(seqs, outputs, strict=True):
            assert out.error is None, out.error
            if seq.sample:
                assert out.token_id is not None
                ids[seq.seq_id].append(out.token_id)
    raise AssertionError("unreachable")


def test_step_executor_serves_a_llama_family_model_token_for_token(tiny_checkpoints):
    ckpt = tiny_checkpoints["llama_tied"]
    prompts = [random_ids(n, seed=300 + n) for n in (4, 11, 23, 38)]
    expected, margin = transformers_greedy(ckpt.reference, prompts, 32)
    assert margin >= GREEDY_MIN_MARGIN, f"a near-tie in the reference ({margin:.1e}): choose other seeds"
    executor = StepExecutor(generator_of(ckpt), num_kv_blocks=64, block_size=4)
    assert executor_greedy(executor, prompts, 32, prefill_chunk=6) == expected
