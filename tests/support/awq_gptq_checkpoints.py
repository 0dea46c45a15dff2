"""Tiny AWQ and GPTQ checkpoints made from the tiny float32 ones (tests/support/hf_checkpoints.py), packed
as AutoAWQ (GEMM) and AutoGPTQ / GPTQModel store them. Nothing is downloaded, and no quantization
library runs: each Linear weight is quantized here by round-to-nearest over its groups (what GPTQ's
error feedback and AWQ's scale search start from; the packing, not the search, is under test).

Per group of inputs and per output: scale `s = (max - min) / (2^bits - 1)` (stored float16), zero
`z = round(-min / s)`, code `q = clamp(round(w / s) + z, 0, 2^bits - 1)`; the weight the checkpoint
means is `(q - z) * float32(s)`, exactly. With act-order (GPTQ's desc_act) the inputs are grouped in
a permuted order (by descending weight norm, as act-order sorts by the Hessian's diagonal), so an
input's group is g_idx[input], not input // group_size.

The packers are written from the formats' descriptions, independently of the worker's unpacking:
AWQ puts output `8c + AWQ_ORDER[i]` in bits 4i..4i+3 of column c; GPTQ puts input `r * 32 / bits + i`
in bits `bits * i` of row r, and its v1 format stores each zero minus one.

`quantize_checkpoint` rewrites a checkpoint's weights quantized and returns the weights it means as
float32; `save_dequantized` (tests/support/fp8_checkpoints.py) writes those as a plain checkpoint,
transformers' reference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class IntScheme:
    """How to quantize: `method` "awq" or "gptq"; `group_size` None: one group (GPTQ's -1); `ignore`:
    modules left unquantized (names, or "re:" patterns), as modules_to_not_convert says them."""

    method: str
    bits: int = 4
    group_size: int | None = 32
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # or "gptq_v2": zeros stored as they are
    sym: bool = False
    ignore: Sequence[str] = ("lm_head",)
    scale_dtype: torch.dtype = torch.float16

    def quantization_config(self) -> dict[str, Any]:
        group_size = -1 if self.group_size is None else self.group_size
        not_converted = [rule.removeprefix("re:.*") for rule in self.ignore if rule != "lm_head"] or None
        if self.method == "awq":  # as transformers' AwqConfig.to_dict() writes it after AutoAWQ
            return {"quant_method": "awq", "bits": self.bits, "group_size": group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": not_converted}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": group_size, "desc_act": self.desc_act,
                "sym": self.sym, "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
                "checkpoint_format": self.checkpoint_format, "model_name_or_path": None,
                "model_file_base_name": None, "lm_head": "lm_head" not in self.ignore}

    def ignores(self, module: str) -> bool:
        return any(re.fullmatch(rule[3:], module) if rule.startswith("re:") else module == rule
                   for rule in self.ignore)


@dataclass(frozen=True)
class Quantized:
    """A Linear weight `[out, in]` quantized: its codes, zeros, scales and groups as plain tensors."""

    codes: torch.Tensor  # int64 [in, out], each in [0, 2^bits)
    zeros: torch.Tensor  # int64 [groups, out]
    scales: torch.Tensor  # [groups, out], the scheme's scale dtype
    g_idx: torch.Tensor  # int64 [in]: each input's group

    def dequantized(self) -> torch.Tensor:
        """float32 `[out, in]`: the weight the checkpoint means, `(q - z) * s` (exact in float32)."""
        return ((self.codes - self.zeros[self.g_idx]).float() * self.scales.float()[self.g_idx]).T.contiguous()


def quantize(weight: torch.Tensor, scheme: IntScheme) -> Quantized:
    """Round-to-nearest over each group of `weight`'s ([out, in]) inputs."""
    w = weight.float().T  # [in, out]
    in_, _ = w.shape
    size = in_ if scheme.group_size is None else scheme.group_size
    order = torch.argsort(w.norm(dim=1), descending=True, stable=True) if scheme.desc_act else torch.arange(in_)
    g_idx = torch.empty(in_, dtype=torch.int64)
    g_idx[order] = torch.arange(in_) // size  # the i-th input in act order is in group i // size
    top = (1 << scheme.bits) - 1
    num_groups = in_ // size
    scales = torch.empty(num_groups, w.shape[1])
    zeros = torch.empty(num_groups, w.shape[1], dtype=torch.int64)
    for g in range(num_groups):
        rows = w[g_idx == g]
        low, high = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scale = ((high - low) / top).clamp(min=1e-4).to(scheme.scale_dtype)
        scales[g] = scale.float()
        zero = (1 << (scheme.bits - 1)) if scheme.sym else torch.round(-low / scale.float())
        # The v1 format stores zero - 1 and cannot say a zero of 0 (it packs as -1, all ones).
        zeros[g] = torch.as_tensor(zero).clamp(1 if scheme.checkpoint_format == "gptq" else 0, top).long()
    codes = torch.round(w / scales[g_idx]).long() + zeros[g_idx]
    return Quantized(codes.clamp(0, top), zeros, scales.to(scheme.scale_dtype), g_idx)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int32 `[rows, cols / 8]`: 4-bit `values` ([rows, cols]) packed along the columns in AutoAWQ's order."""
    v = values.numpy().astype(np.uint32)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for c in range(packed.shape[1]):
        for i, output in enumerate(AWQ_ORDER):
            packed[:, c] |= v[:, 8 * c + output] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32).copy())


def pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[rows * bits / 32, cols]`: `values` packed down the rows, 32 / bits to an int32, in order."""
    v, per = values.numpy().astype(np.uint32), 32 // bits
    packed = np.zeros((v.shape[0] // per, v.shape[1]), dtype=np.uint32)
    for r in range(packed.shape[0]):
        for i in range(per):
            packed[r] |= v[r * per + i] << np.uint32(bits * i)
    return torch.from_numpy(packed.view(np.int32).copy())


def pack_gptq_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 `[rows, cols * bits / 32]`: `values` packed along the columns, in order."""
    return pack_gptq_rows(values.T.contiguous(), bits).T.contiguous()


def stored_parts(quantized: Quantized, scheme: IntScheme) -> dict[str, torch.Tensor]:
    """What a checkpoint stores for the weight: qweight, qzeros, scales (and g_idx for GPTQ)."""
    if scheme.method == "awq":
        return {"qweight": pack_awq(quantized.codes), "qzeros": pack_awq(quantized.zeros), "scales": quantized.scales}
    offset = 1 if scheme.checkpoint_format == "gptq" else 0
    return {"qweight": pack_gptq_rows(quantized.codes, scheme.bits),
            "qzeros": pack_gptq_columns(quantized.zeros - offset, scheme.bits), "scales": quantized.scales,
            "g_idx": quantized.g_idx.to(torch.int32)}


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and name != "model.embed_tokens.weight"


def quantize_checkpoint(directory: Path, scheme: IntScheme) -> dict[str, torch.Tensor]:
    """Rewrites `directory`'s model.safetensors with every Linear weight the scheme does not ignore stored
    quantized (its parts in its place) and config.json with the scheme's quantization_config. Returns
    every tensor as the dequantized float32 checkpoint holds it."""
    path = directory / "model.safetensors"
    stored, dequantized = {}, {}
    for name, tensor in load_file(path).items():
        module = name.removesuffix(".weight")
        if not is_linear_weight(name, tensor) or scheme.ignores(module):
            stored[name] = dequantized[name] = tensor
            continue
        quantized = quantize(tensor, scheme)
        stored.update({f"{module}.{part}": value for part, value in stored_parts(quantized, scheme).items()})
        dequantized[name] = quantized.dequantized()
    save_file(stored, path, metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = scheme.quantization_config()
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized
