"""LoRA adapters served over a Llama-family model equal the base model with the adapter merged into its
weights (`W + scale * B @ A`, merged by tests/support/lora_adapters from the files alone), alone and in
steps that mix the base model and two adapters.

Tolerance: float32 logits within 2e-4 of the merged model's (the LoRA path adds the delta after the
base matmul; the merged model rounds once, so they differ in the last bits only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.models.generator import Generator
from services.worker.models.llama_weights import load_llama_family, read_config
from services.worker.models.lora import load_lora_adapter
from services.worker.models.paged import PagedSequence
from tests.support.lora_adapters import save_lora_adapter, save_merged_checkpoint

ATOL = 2e-4
PROMPT = (5, 17, 99, 3, 250, 41, 7, 88, 123, 61, 9, 300, 12, 77, 4, 200, 33)
# Every linear (on Phi-3: its fused qkv_proj / gate_up_proj, as its adapters store them).
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def generator(directory: Path) -> Generator:
    return Generator(load_llama_family(directory), max_seq_len=128, eos_token_id=2, bos_token_id=1)


def paged_logits(gen: Generator, prompt, adapter: str = "", *, block_size: int = 4) -> torch.Tensor:
    """Every prompt position's logits (two chunks, then a decode step), through the paged step."""
    cache = gen.new_kv_cache(-(-len(prompt) // block_size) + 1, block_size)
    table = tuple(reversed(range(cache.num_blocks)))
    cut = len(prompt) // 2
    rows = [gen.step([PagedSequence(tuple(prompt[:cut]), 0, table, True, all_logits=True, adapter=adapter)], cache),
            gen.step([PagedSequence(tuple(prompt[cut:-1]), cut, table, True, all_logits=True, adapter=adapter)], cache),
            gen.step([PagedSequence((prompt[-1],), len(prompt) - 1, table, True, adapter=adapter)], cache)]
    return torch.cat(rows)


@pytest.mark.parametrize(("family", "targets", "rslora"), [
    ("llama", ALL, False), ("qwen2", ("q_proj", "v_proj", "down_proj"), True), ("phi3", FUSED, False)])
def test_adapter_logits_equal_the_merged_model(tiny_checkpoints, tmp_path, family, targets, rslora):
    base = tiny_checkpoints[family].directory
    adapter_dir = save_lora_adapter(tmp_path / "a", base, targets=targets, rank=4, alpha=8, use_rslora=rslora)
    served = generator(base)
    served.add_lora(load_lora_adapter("a", adapter_dir, read_config(base)))
    merged = generator(save_merged_checkpoint(tmp_path / "merged", base, adapter_dir))

    got, want = paged_logits(served, PROMPT, "a"), paged_logits(merged, PROMPT)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
    # The adapter changes the model (else the test would prove nothing), and the base is untouched.
    base_logits = paged_logits(served, PROMPT)
    assert (base_logits - want).abs().max() > 100 * ATOL
    assert torch.equal(base_logits, paged_logits(generator(base), PROMPT))


def test_a_step_mixing_the_base_and_two_adapters_equals_each_alone(tiny_checkpoints, tmp_path):
    base = tiny_checkpoints["qwen2"].directory
    config = read_config(base)
    served = generator(base)
    served.add_lora(load_lora_adapter("x", save_lora_adapter(tmp_path / "x", base, targets=ALL, seed=1), config))
    served.add_lora(load_lora_adapter("y", save_lora_adapter(tmp_path / "y", base, targets=("q_proj", "o_proj"),
                                                             rank=2, seed=2), config))
    prompts = {"": PROMPT[:9], "x": PROMPT[3:15], "y": PROMPT[:13]}
    alone = {name: paged_logits(served, prompt, name) for name, prompt in prompts.items()}

    # One shared cache; each step carries all three: a first chunk, then the rest, then one decode token.
    block_size = 4
    cache = served.new_kv_cache(16, block_size)
    tables = {name: tuple(range(5 * i, 5 * i + 5)) for i, name in enumerate(prompts)}
    got: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    spans = {name: [(0, len(p) // 2), (len(p) // 2, len(p) - 1), (len(p) - 1, len(p))] for name, p in prompts.items()}
    for part in range(3):
        seqs = [PagedSequence(tuple(prompts[n][a:b]), a, tables[n], True, all_logits=part < 2, adapter=n)
                for n, (a, b) in ((n, spans[n][part]) for n in prompts)]
        logits = served.step(seqs, cache)
        row = 0
        for name, seq in zip(prompts, seqs, strict=True):
            num = len(seq.token_ids) if seq.all_logits else 1
            got[name].append(logits[row:row + num])
            row += num
    for name in prompts:
        assert torch.allclose(torch.cat(got[name]), alone[name], atol=ATOL, rtol=0), name


def test_an_unknown_adapter_is_refused_by_name(tiny_checkpoints, tmp_path):
    base = tiny_checkpoints["llama"].directory
    served = generator(base)
    served.add_lora(load_lora_adapter("a", save_lora_adapter(tmp_path / "a", base), read_config(base)))
    with pytest.raises(KeyError, match="'nope'"):
        paged_logits(served, PROMPT, "nope")
    with pytest.raises(ValueError, match="already loaded"):
        served.add_lora(load_lora_adapter("a", tmp_path / "a", read_config(base)))
