"""A PEFT LoRA adapter directory, read and checked against its base model's config (offline, pure).

A LoRA fine-tune of a served LLM is a directory PEFT writes with `save_pretrained`:
`adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, ...) and `adapter_model.safetensors`
holding, per adapted linear of each layer, `lora_A` `[r, in]` and `lora_B` `[out, r]`
(`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`). The adapted linear computes
`W x + scale * B (A x)` with `scale = lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`).

What we cannot compute exactly is refused with a `CheckpointError` naming the field or tensor, never
served approximately: DoRA, `modules_to_save` (whole modules retrained beside the adapter), adapted
embeddings or LM heads, per-module ranks or alphas, a bias other than `none`, `fan_in_fan_out`,
targets given as a regular expression, a shape or rank that does not fit the base model, a layer
the base model lacks, a mixture of experts' MLP, and a dtype other than float32/16 or bfloat16.
Only the headers are read here; models/lora.py reads the tensors.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from services.worker.models.llama_config import CheckpointError, LlamaFamilyConfig

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# The linears of a layer an adapter may target, by the checkpoint's module names. A base model that
# stores its projections fused (Phi-3) names them qkv_proj and gate_up_proj, and so do its adapters.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
FUSED_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_STORAGE_DTYPES = ("F32", "F16", "BF16")
# Fields whose only served value is "off": each changes what the adapter computes.
_MUST_BE_EMPTY = ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_pattern", "layer_replication",
                  "trainable_token_indices")
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class LoraConfig:
    """What `adapter_config.json` says that the forward needs."""

    rank: int  # r: lora_A's rows, lora_B's columns
    alpha: float  # lora_alpha
    use_rslora: bool  # scale by alpha / sqrt(r) instead of alpha / r
    target_modules: tuple[str, ...]  # checkpoint module names (q_proj, ...), sorted
    base_model: str  # base_model_name_or_path: informational only, never checked against the base

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class LoraTensorPair:
    """One adapted linear of one layer: where its two tensors are stored."""

    layer: int
    module: str  # q_proj, ..., or qkv_proj / gate_up_proj on a fused base
    a_name: str  # lora_A: [rank, in]
    b_name: str  # lora_B: [out, rank]


def read_lora_config(directory: str | Path, config: LlamaFamilyConfig, *,
                     file: str = ADAPTER_CONFIG_FILE) -> LoraConfig:
    """The directory's adapter_config.json (in a repository version: its pinned copy, `file`), checked
    against the base model's `config`."""
    path = Path(directory) / file
    data = _read_json(path)
    file = str(path)

    def fail(field: str, problem: str) -> CheckpointError:
        return CheckpointError(file, field, problem)

    peft_type = data.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail("peft_type", f"only LORA adapters are served, got {peft_type!r}")
    if data.get("use_dora"):
        raise fail("use_dora", "DoRA adapters are not served (their magnitude vector rescales the merged weight)")
    for name in _MUST_BE_EMPTY:
        if data.get(name):
            raise fail(name, f"must be empty or absent, got {data[name]!r}: not served")
    if data.get("bias", "none") != "none":
        raise fail("bias", f"only 'none' is served, got {data['bias']!r}")
    if data.get("fan_in_fan_out", False):
        raise fail("fan_in_fan_out", "must be false: the family's linears are not Conv1D")
    rank = data.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail("r", f"must be a positive int, got {rank!r}")
    alpha = data.get("lora_alpha", 8)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise fail("lora_alpha", f"must be a positive number, got {alpha!r}")
    use_rslora = data.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise fail("use_rslora", f"must be true or false, got {use_rslora!r}")
    base = data.get("base_model_name_or_path") or ""
    return LoraConfig(rank, float(alpha), use_rslora, _targets(data.get("target_modules"), config, fail),
                      base if isinstance(base, str) else str(base))


def _targets(value: Any, config: LlamaFamilyConfig, fail: Any) -> tuple[str, ...]:
    allowed = FUSED_TARGETS if config.fused_projections else ATTENTION_TARGETS + MLP_TARGETS
    if value == "all-linear":  # PEFT's shorthand: every linear but the LM head
        return tuple(sorted(allowed))
    if isinstance(value, str):
        value = [value] if value in allowed else value
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise fail("target_modules", f"must be a non-empty list of module names ({', '.join(allowed)}) or "
                   f"'all-linear', got {value!r} (a regular expression is not served)")
    for name in value:
        if name in ("embed_tokens", "lm_head"):
            raise fail("target_modules", f"{name} is not served: only the layers' linears ({', '.join(allowed)})")
        if name not in allowed:
            fused = " (this base stores its projections fused)" if config.fused_projections else ""
            raise fail("target_modules", f"unknown module {name!r}{fused}; served: {', '.join(allowed)}")
    return tuple(sorted(set(value)))


def lora_shape(module: str, config: LlamaFamilyConfig) -> tuple[int, int]:
    """(in, out) features of a layer's `module` in the base model."""
    c = config
    q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    return {
        "q_proj": (c.d_model, q_size), "k_proj": (c.d_model, kv_size), "v_proj": (c.d_model, kv_size),
        "qkv_proj": (c.d_model, q_size + 2 * kv_size), "o_proj": (q_size, c.d_model),
        "gate_proj": (c.d_model, c.d_ff), "up_proj": (c.d_model, c.d_ff),
        "gate_up_proj": (c.d_model, 2 * c.d_ff), "down_proj": (c.d_ff, c.d_model),
    }[module]


def check_lora_weights(directory: str | Path, lora: LoraConfig, config: LlamaFamilyConfig, *,
                       file: str = ADAPTER_WEIGHTS_FILE) -> list[LoraTensorPair]:
    """Checks adapter_model.safetensors' header (or `file`'s; no tensor data is read) against `lora` and
    the base `config`; returns each adapted linear's pair, by layer then module. CheckpointError names the
    tensor."""
    path = Path(directory) / file
    file = str(path)
    try:
        weights = safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # a missing file, a corrupt header: an adapter we cannot serve
        raise CheckpointError(file, "header", f"not a readable safetensors file: {e}") from e
    found: dict[tuple[int, str], dict[str, str]] = {}
    with weights:
        for name in sorted(weights.keys()):
            layer, module, side = _parse_name(file, name, lora, config)
            tensor = weights.get_slice(name)
            _check_tensor(file, name, tuple(tensor.get_shape()), tensor.get_dtype(), module, side, lora, config)
            found.setdefault((layer, module), {})[side] = name
    if not found:
        raise CheckpointError(file, "(file)", "holds no lora_A / lora_B tensors")
    pairs = []
    for (layer, module), sides in sorted(found.items()):
        for side in "AB":
            if side not in sides:
                other = next(iter(sides.values()))
                raise CheckpointError(file, other, f"its lora_{side} twin is missing")
        pairs.append(LoraTensorPair(layer, module, sides["A"], sides["B"]))
    return pairs


def _parse_name(file: str, name: str, lora: LoraConfig, config: LlamaFamilyConfig) -> tuple[int, str, str]:
    match = _TENSOR.fullmatch(name)
    if match is None:
        raise CheckpointError(file, name, "unexpected tensor: a LoRA adapter stores only "
                              "base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_<A|B>.weight")
    layer, block, module, side = int(match[1]), match[2], match[3], match[4]
    if module not in lora.target_modules:
        raise CheckpointError(file, name, f"module {module!r} is not in target_modules "
                              f"({', '.join(lora.target_modules)})")
    if (block == "mlp") != (module in MLP_TARGETS + ("gate_up_proj", "down_proj")):
        raise CheckpointError(file, name, f"{module} does not belong under {block}")
    if layer >= config.num_layers:
        raise CheckpointError(file, name, f"layer {layer} is out of range: the base model has "
                              f"{config.num_layers} layers")
    if block == "mlp" and config.experts is not None and config.has_experts(layer):
        raise CheckpointError(file, name, f"layer {layer}'s MLP is a mixture of experts: LoRA on experts "
                              "is not served")
    return layer, module, side


def _check_tensor(file: str, name: str, shape: tuple[int, ...], dtype: str, module: str, side: str,
                  lora: LoraConfig, config: LlamaFamilyConfig) -> None:
    if dtype not in _STORAGE_DTYPES:
        raise CheckpointError(file, name, f"dtype {dtype} is not served (F32, F16 or BF16)")
    in_features, out_features = lora_shape(module, config)
    expected = (lora.rank, in_features) if side == "A" else (out_features, lora.rank)
    if shape != expected:
        raise CheckpointError(file, name, f"shape {list(shape)}, expected {list(expected)} (r={lora.rank} "
                              f"from {ADAPTER_CONFIG_FILE}, {module} is {in_features} -> {out_features} "
                              "in the base model)")


def _read_json(path: Path) -> Mapping[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(str(path), "(file)", "missing from the adapter directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(path), "(file)", f"not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(str(path), "(top level)", f"must be a JSON object, got {type(data).__name__}")
    return data
