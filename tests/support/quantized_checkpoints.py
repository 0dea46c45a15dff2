"""What the quantized-checkpoint tests (FP8, AWQ / GPTQ) hold each format to, in one place: a tiny
checkpoint per variant quantized by the test's own packer beside a plain float32 checkpoint of the
weights it means (transformers' reference), and the checks that the loaded weights, logits, greedy
tokens and memory estimate are the dense checkpoint's."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from services.worker.models.llama_weights import load_llama_family, read_config
from services.worker.repository.hf_import import weight_bytes
from tests.support.fp8_checkpoints import save_dequantized
from tests.unit.worker.models.test_llama_family import (
    GREEDY_MIN_MARGIN,
    LOGITS_TOLERANCE,
    paged_greedy,
    random_ids,
    transformers_greedy,
)

# A packer: quantizes the checkpoint in `directory` in place by `scheme`, returns the dequantized weights.
Quantize = Callable[[Path, Any], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class QuantizedCheckpoint:
    directory: Path  # the quantized checkpoint
    dense: Path  # the weights it means, as a plain float32 checkpoint
    reference: transformers.PreTrainedModel  # transformers on `dense`


def make_checkpoints(tiny_checkpoints: Mapping[str, Any], tmp_path_factory: Any,
                     variants: Mapping[str, tuple[str, Any]], quantize: Quantize) -> dict[str, QuantizedCheckpoint]:
    """Each variant (name → (family, scheme)): the family's tiny checkpoint, quantized, beside its dense twin."""
    made = {}
    for variant, (family, scheme) in variants.items():
        root = tmp_path_factory.mktemp(variant)
        directory, dense = root / "quantized", root / "dense"
        shutil.copytree(tiny_checkpoints[family].directory, directory)
        save_dequantized(directory, dense, quantize(directory, scheme))
        reference = transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
        made[variant] = QuantizedCheckpoint(directory, dense, reference)
    return made


def assert_loads_as_the_dense_checkpoint(ckpt: QuantizedCheckpoint, dtype: torch.dtype) -> None:
    """Dequantized in float32 and rounded once to `dtype`: bit for bit what the dense checkpoint loads as."""
    got, expected = load_llama_family(ckpt.directory, dtype=dtype), load_llama_family(ckpt.dense, dtype=dtype)
    assert got.config.quantization is not None and expected.config.quantization is None
    expected_state = expected.state_dict()
    for name, tensor in got.state_dict().items():
        assert torch.equal(tensor, expected_state[name]), name


def assert_logits_match_transformers(ckpt: QuantizedCheckpoint) -> None:
    lm = load_llama_family(ckpt.directory)
    ids = torch.tensor([random_ids(60, seed=1), random_ids(60, seed=2)])
    with torch.inference_mode():
        torch.testing.assert_close(lm(ids), ckpt.reference(ids).logits, **LOGITS_TOLERANCE)


def assert_greedy_matches_transformers(ckpt: QuantizedCheckpoint, seed: int) -> None:
    """A few prompts continuously batched through the paged path (4-token blocks, 7-token prefill chunks)
    against transformers' greedy generate."""
    prompts = [random_ids(n, seed=seed + n) for n in (5, 11, 23)]
    expected, margin = transformers_greedy(ckpt.reference, prompts, 12)
    assert margin >= GREEDY_MIN_MARGIN, f"a near-tie in the reference ({margin:.1e}): choose other prompts"
    assert paged_greedy(load_llama_family(ckpt.directory), prompts, 12, block_size=4, prefill_chunk=7) == expected


def assert_memory_estimate_counts_the_dequantized_weights(ckpt: QuantizedCheckpoint) -> None:
    lm = load_llama_family(ckpt.directory)
    held = sum(p.numel() * p.element_size() for p in lm.parameters())
    assert weight_bytes(lm.config) == held == weight_bytes(read_config(ckpt.dense))
    assert (ckpt.directory / "model.safetensors").stat().st_size < held  # the file holds fewer bytes a value
