"""Tiny FP8 checkpoints made from the tiny float32 ones (tests/support/hf_checkpoints.py), as the two
schemes the worker reads publish them: fp8 (DeepSeek / Qwen3-FP8: float8_e4m3fn weights with a float32
`weight_scale_inv` per block) and compressed-tensors (llm-compressor: `weight_scale` per tensor or per
channel, an `ignore` list). Each quantized Linear weight's block, row or tensor maximum maps to 448
(float8_e4m3fn's largest value), as the quantizers do. Nothing is downloaded.

`quantize_checkpoint` rewrites a checkpoint's weights quantized and returns the dequantized float32
weights; `save_dequantized` writes those as a plain checkpoint, which transformers loads as the
reference.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


@dataclass(frozen=True)
class Fp8Scheme:
    """How to quantize: `method` "fp8" (per block of `block`) or "compressed-tensors" (`strategy`
    "tensor", "channel" or "block"); `ignore`: modules left unquantized (names, or "re:" patterns)."""

    method: str
    strategy: str = "block"
    block: tuple[int, int] = (32, 48)  # ragged against 64 x 128 weights: partial blocks at the edges
    ignore: Sequence[str] = ("lm_head",)
    scale_dtype: torch.dtype = torch.float32
    static_activations: bool = False

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"

    def quantization_config(self) -> dict[str, Any]:
        if self.method == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                    "activation_scheme": "static" if self.static_activations else "dynamic",
                    "modules_to_not_convert": list(self.ignore)}
        weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": self.strategy,
                                   "dynamic": False, "group_size": None, "block_structure": None,
                                   "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        if self.strategy == "block":
            weights["block_structure"] = list(self.block)
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                       "strategy": "tensor" if self.static_activations else "token",
                       "dynamic": not self.static_activations, "observer": None if not self.static_activations
                       else "minmax", "block_structure": None, "actorder": None, "observer_kwargs": {}}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": activations, "output_activations": None}},
                "ignore": list(self.ignore), "kv_cache_scheme": None, "global_compression_ratio": None}

    def ignores(self, module: str) -> bool:
        return any(re.fullmatch(rule[3:], module) if rule.startswith("re:") else module == rule
                   for rule in self.ignore)

    def cell(self, weight: torch.Tensor) -> tuple[int, int]:
        """The rows and columns of `weight` one scale covers."""
        out, in_ = weight.shape
        if self.method == "compressed-tensors" and self.strategy == "tensor":
            return out, in_
        if self.method == "compressed-tensors" and self.strategy == "channel":
            return 1, in_
        return self.block


def expand(scale: torch.Tensor, cell: tuple[int, int], shape: tuple[int, ...]) -> torch.Tensor:
    """A scale of `cell`-sized cells spread over the weight's every value (`float32[out, in]`)."""
    out, in_ = shape
    grid = scale.float().reshape(-(-out // cell[0]), -(-in_ // cell[1]))
    return grid.repeat_interleave(cell[0], 0)[:out].repeat_interleave(cell[1], 1)[:, :in_]


def quantize(weight: torch.Tensor, scheme: Fp8Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, its scale in scheme.scale_dtype): each block's, row's or the tensor's
    largest magnitude maps to FP8_MAX."""
    weight = weight.float()
    rows, cols = scheme.cell(weight)
    grid = (-(-weight.shape[0] // rows), -(-weight.shape[1] // cols))
    shape = (1,) if scheme.strategy == "tensor" and scheme.method != "fp8" else grid
    amax = torch.zeros(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax[i, j] = weight[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max()
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(scheme.scale_dtype).reshape(shape)
    quantized = (weight / expand(scale, (rows, cols), tuple(weight.shape))).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and name != "model.embed_tokens.weight"


def quantize_checkpoint(directory: Path, scheme: Fp8Scheme) -> dict[str, torch.Tensor]:
    """Rewrites `directory`'s model.safetensors with every Linear weight the scheme does not ignore
    quantized (its scale beside it; with static activations an input scale too) and config.json with the
    scheme's quantization_config. Returns every tensor as the dequantized float32 checkpoint holds it."""
    path = directory / "model.safetensors"
    tensors, stored = load_file(path), {}
    dequantized = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not is_linear_weight(name, tensor) or scheme.ignores(module):
            stored[name] = dequantized[name] = tensor
            continue
        weight, scale = quantize(tensor, scheme)
        stored[name], stored[f"{module}.{scheme.scale_name}"] = weight, scale
        if scheme.static_activations:
            stored[f"{module}.input_scale"] = torch.tensor([0.05], dtype=scheme.scale_dtype)
        dequantized[name] = weight.float() * expand(scale, scheme.cell(weight), tuple(weight.shape))
    save_file(stored, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = scheme.quantization_config()
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def save_dequantized(source: Path, target: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """A plain float32 checkpoint of the dequantized weights beside `source`'s other files (its
    config.json without quantization_config): what transformers loads as the reference."""
    shutil.copytree(source, target)
    save_file(dequantized, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    del config["quantization_config"]
    (target / "config.json").write_text(json.dumps(config, indent=2))
