"""PEFT-shaped LoRA adapter directories for tiny checkpoints, and their merged-weight references (tests only).

`save_lora_adapter(dir, base_dir, ...)` writes what PEFT's `save_pretrained` writes (adapter_config.json
and adapter_model.safetensors with random A and B: PEFT zeroes B at init, which would test nothing).
`save_merged_checkpoint(dir, base_dir, adapter_dir)` writes the base checkpoint with each adapted
weight replaced by `W + scale * B @ A`, computed here from the files alone: the reference an adapter
served over the base must equal.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "qkv_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "gate_up_proj": "mlp"}


def adapter_tensor(layer: int, module: str, side: str) -> str:
    return f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}.lora_{side}.weight"


def save_lora_adapter(directory: str | Path, base_dir: str | Path, *, targets: Sequence[str] = ("q_proj", "v_proj"),
                      rank: int = 4, alpha: float = 8.0, seed: int = 0, std: float = 0.2,
                      use_rslora: bool = False, layers: Sequence[int] | None = None,
                      dtype: torch.dtype = torch.float32, **config: Any) -> Path:
    """An adapter over the checkpoint in `base_dir` on `targets` of `layers` (default: all); `config`
    adds or overrides adapter_config.json's fields."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = load_file(str(Path(base_dir) / "model.safetensors"))
    num_layers = json.loads((Path(base_dir) / "config.json").read_text())["num_hidden_layers"]
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers) if layers is None else layers:
        for module in targets:
            # A layer the base lacks takes layer 0's shapes (the refusal tests' out-of-range layer).
            out_features, in_features = base[f"model.layers.{layer if layer < num_layers else 0}.{_BLOCK[module]}.{module}.weight"].shape
            tensors[adapter_tensor(layer, module, "A")] = torch.randn(rank, in_features, generator=generator) * std
            tensors[adapter_tensor(layer, module, "B")] = torch.randn(out_features, rank, generator=generator) * std
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(directory / "adapter_model.safetensors"))
    fields = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir), "r": rank,
              "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets), "bias": "none",
              "fan_in_fan_out": False, "use_rslora": use_rslora, "use_dora": False, "modules_to_save": None,
              "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, **config}
    (directory / "adapter_config.json").write_text(json.dumps(fields))
    return directory


def save_merged_checkpoint(directory: str | Path, base_dir: str | Path, adapter_dir: str | Path) -> Path:
    """The base checkpoint with the adapter merged into its weights (float32), beside a copy of its config."""
    directory, base_dir, adapter_dir = Path(directory), Path(base_dir), Path(adapter_dir)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = {k: v.float() for k, v in load_file(str(base_dir / "model.safetensors")).items()}
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        target = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + scale * (b.double() @ a.double()).float()
    save_file(weights, str(directory / "model.safetensors"))
    shutil.copy(base_dir / "config.json", directory / "config.json")
    return directory
