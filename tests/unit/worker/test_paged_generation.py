"""The paged path (chunked prefill + decode kernel, interleaved sequences) against the dense forward."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from services.worker.models.paged import KVCache, PagedSequence, check_sequence
from services.worker.repository.loader import LoadedModel
from services.worker.step_executor import StepExecutor
from services.worker.work import RunStep, SequenceStep

BOS = 257
TEXT = (
    "Python is an easy to learn, powerful programming language. It has efficient high-level data structures "
    "and a simple but effective approach to object-oriented programming. Python's elegant syntax and dynamic "
    "typing, together with its interpreted nature, make it an ideal language for scripting and rapid development."
)
# Prompt lengths in bytes (BOS comes on top): single token, around the 32-token chunk, several chunks.
PROMPT_LENGTHS = [0, 1, 3, 7, 12, 20, 30, 31, 32, 33, 45, 63, 64, 65, 90, 111, 128, 150, 177, 220]


@dataclass
class _Seq:
    seq_id: int
    tokens: list[int]
    num_prompt: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    started: bool = False

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.num_prompt:]


def _drive(executor: StepExecutor, prompts: list[list[int]], num_new: int, *, chunk: int, token_budget: int,
           max_running: int) -> list[list[int]]:
    """A tiny continuous-batching scheduler: admits up to max_running, chunked prefill under a token budget."""
    block_size = executor.block_size
    free = list(range(executor.num_kv_blocks))
    random.Random(7).shuffle(free)  # block tables are scattered, never the identity
    waiting = [_Seq(i, list(p), len(p)) for i, p in enumerate(prompts)]
    running: list[_Seq] = []
    done: dict[int, list[int]] = {}
    finished: list[int] = []
    step_id = 0
    while waiting or running:
        while waiting and len(running) < max_running:
            running.append(waiting.pop(0))
        budget = token_budget
        steps, planned = [], []
        for seq in running:
            n = min(len(seq.tokens) - seq.num_computed, chunk, budget)
            if n == 0:
                continue
            budget -= n
            end = seq.num_computed + n
            num_new_blocks = -(-end // block_size) - len(seq.blocks)
            new_blocks = [free.pop() for _ in range(max(0, num_new_blocks))]
            seq.blocks += new_blocks
            sample = end == len(seq.tokens)
            steps.append(SequenceStep(
                seq.seq_id, tuple(seq.tokens[seq.num_computed:end]), seq.num_computed, tuple(new_blocks),
                reset_block_table=not seq.started, sample=sample, num_generated=len(seq.generated),
            ))
            seq.started = True
            planned.append((seq, n))
        outputs, _ = executor.run(RunStep(step_id, tuple(steps), tuple(finished)))
        step_id += 1
        finished = []
        for (seq, n), out in zip(planned, outputs, strict=True):
            assert out.error is None, out.error
            seq.num_computed += n
            if out.token_id is not None:
                seq.tokens.append(out.token_id)
                if len(seq.generated) == num_new:
                    done[seq.seq_id] = seq.generated
                    running.remove(seq)
                    free += seq.blocks
                    finished.append(seq.seq_id)
    return [done[i] for i in range(len(prompts))]


def _greedy_given_each_prefix(generator, prompt: list[int], tokens: list[int]) -> list[int]:
    """The dense model's greedy pick at each generated position, given the tokens before it: equal to
    tokens exactly when they are the dense greedy continuation (by induction over positions). One
    causal forward over prompt + tokens replaces greedy_dense's forward per new token (47 s -> a few)."""
    logits = generator.dense_logits([*prompt, *tokens])
    return [int(logits[len(prompt) - 1 + t].argmax()) for t in range(len(tokens))]


def test_greedy_paged_generation_equals_dense_on_20_interleaved_prompts(tinylm: LoadedModel) -> None:
    generator = tinylm.generator
    prompts = [[BOS, *TEXT[:n].encode()] for n in PROMPT_LENGTHS]
    assert len(prompts) == 20 and max(map(len, prompts)) > 2 * 32
    executor = StepExecutor(generator, num_kv_blocks=96, block_size=16)
    paged = _drive(executor, prompts, num_new=10, chunk=32, token_budget=80, max_running=6)
    for prompt, tokens in zip(prompts, paged, strict=True):
        assert tokens == _greedy_given_each_prefix(generator, prompt, tokens), f"prompt of {len(prompt)} tokens diverged"
    assert paged[5] == generator.greedy_dense(prompts[5], 10), "and greedy_dense itself agrees"
    assert executor.num_sequences == 1  # the last finished sequence is forgotten on the next step only


def test_chunked_prefill_and_decode_logits_match_dense(tinylm: LoadedModel) -> None:
    generator = tinylm.generator
    ids = [BOS, *TEXT[:100].encode()]
    dense = generator.dense_logits(ids)
    cache = generator.new_kv_cache(num_blocks=13, block_size=8)
    table = (11, 3, 7, 0, 9, 1, 5, 2, 10, 4, 8, 12, 6)
    pos = 0
    for n in (37, 20, 1, 1, 30, 1, len(ids) - 90):
        logits = generator.step([PagedSequence(tuple(ids[pos:pos + n]), pos, table, needs_logits=True)], cache)
        pos += n
        torch.testing.assert_close(logits[0], dense[pos - 1], rtol=1e-4, atol=1e-4)
    assert pos == len(ids)


def test_paged_sequence_needs_a_block_table_covering_its_positions() -> None:
    cache = KVCache(num_layers=1, num_blocks=4, block_size=8, num_kv_heads=1, head_size=4)
    with pytest.raises(ValueError, match="block table has 1 blocks but positions up to 8 need 2"):
        check_sequence(PagedSequence((1, 2), 7, (0,), needs_logits=True), cache)
    with pytest.raises(ValueError, match=r"block ids \[4\] are outside the cache's 4 blocks"):
        check_sequence(PagedSequence((1,), 0, (4,), needs_logits=True), cache)


def test_the_host_twins_and_the_checked_reference_kernels_give_the_same_logits(tinylm: LoadedModel, monkeypatch) -> None:
    """On the CPU paged_forward calls the kernels' CPU twins directly (checked once per step);
    INFERMESH_KERNEL_BACKEND=reference sends the same step through the checked public kernels."""
    generator = tinylm.generator
    ids = [BOS, *TEXT[:40].encode()]
    table = (5, 2, 7, 0)

    def logits_by_step() -> list[torch.Tensor]:
        cache = generator.new_kv_cache(num_blocks=8, block_size=16)
        out, pos = [], 0
        for n in (30, len(ids) - 30 - 3, 1, 1, 1):
            out.append(generator.step([PagedSequence(tuple(ids[pos:pos + n]), pos, table, needs_logits=True)], cache))
            pos += n
        return out

    monkeypatch.delenv("INFERMESH_KERNEL_BACKEND", raising=False)
    host = logits_by_step()
    monkeypatch.setenv("INFERMESH_KERNEL_BACKEND", "reference")
    for on_host, checked in zip(host, logits_by_step(), strict=True):
        torch.testing.assert_close(on_host, checked, rtol=1e-5, atol=1e-5)
