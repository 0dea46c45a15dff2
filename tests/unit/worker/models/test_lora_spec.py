"""PEFT adapter directories lora_spec accepts and refuses, each refusal naming the field or tensor."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.models.llama_config import CheckpointError
from services.worker.models.llama_weights import read_config
from services.worker.repository.lora_spec import check_lora_weights, read_lora_config
from tests.support.lora_adapters import adapter_tensor, save_lora_adapter


@pytest.fixture
def llama(tiny_checkpoints):
    return tiny_checkpoints["llama"].directory


def adapter(tmp_path: Path, base: Path, **kwargs: Any) -> Path:
    return save_lora_adapter(tmp_path / "adapter", base, **kwargs)


def refusal(directory: Path, base: Path) -> CheckpointError:
    config = read_config(base)
    with pytest.raises(CheckpointError) as caught:
        check_lora_weights(directory, read_lora_config(directory, config), config)
    return caught.value


def edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_reads_rank_alpha_targets_and_pairs(tmp_path, llama):
    directory = adapter(tmp_path, llama, targets=["v_proj", "q_proj", "down_proj"], rank=4, alpha=16)
    config = read_config(llama)
    lora = read_lora_config(directory, config)
    assert (lora.rank, lora.alpha, lora.target_modules, lora.scale) == (4, 16.0, ("down_proj", "q_proj", "v_proj"), 4.0)
    pairs = check_lora_weights(directory, lora, config)
    assert [(p.layer, p.module) for p in pairs] == [(layer, m) for layer in (0, 1)
                                                    for m in ("down_proj", "q_proj", "v_proj")]
    assert pairs[0].a_name == adapter_tensor(0, "down_proj", "A")


def test_rslora_scales_by_the_square_root_of_the_rank(tmp_path, llama):
    directory = adapter(tmp_path, llama, rank=4, alpha=8, use_rslora=True)
    assert read_lora_config(directory, read_config(llama)).scale == pytest.approx(8 / math.sqrt(4))


def test_all_linear_targets_every_layer_linear(tmp_path, llama):
    directory = adapter(tmp_path, llama, target_modules="all-linear")
    assert len(read_lora_config(directory, read_config(llama)).target_modules) == 7


@pytest.mark.parametrize(("fields", "field"), [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 8}}, "alpha_pattern"),
    ({"bias": "lora_only"}, "bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 0}, "r"),
    ({"lora_alpha": "8"}, "lora_alpha"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules"),
    ({"target_modules": ["embed_tokens"]}, "target_modules"),
    ({"target_modules": ".*proj"}, "target_modules"),
    ({"target_modules": ["qkv_proj"]}, "target_modules"),  # fused names only on a fused base (Phi-3)
])
def test_refuses_adapter_config_fields_it_cannot_serve(tmp_path, llama, fields, field):
    directory = adapter(tmp_path, llama)
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    with pytest.raises(CheckpointError) as caught:
        read_lora_config(directory, read_config(llama))
    assert caught.value.field == field


def test_refuses_a_rank_that_does_not_match_the_config(tmp_path, llama):
    directory = adapter(tmp_path, llama, rank=4)
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "r": 8}))
    error = refusal(directory, llama)
    assert "lora_A.weight" in error.field and "[8, 64]" in error.problem


def test_refuses_a_shape_that_does_not_fit_the_base(tmp_path, llama):
    directory = adapter(tmp_path, llama)
    name = adapter_tensor(1, "v_proj", "B")
    edit_tensors(directory, lambda t: t.update({name: torch.zeros(64, 4)}))  # v is 32 wide (2 KV heads)
    error = refusal(directory, llama)
    assert error.field == name and "expected [32, 4]" in error.problem


def test_refuses_a_layer_the_base_lacks(tmp_path, llama):
    directory = adapter(tmp_path, llama, layers=[0, 2])
    error = refusal(directory, llama)
    assert error.field == adapter_tensor(2, "q_proj", "A") and "out of range" in error.problem


def test_refuses_a_tensor_dtype_other_than_float(tmp_path, llama):
    directory = adapter(tmp_path, llama)
    name = adapter_tensor(0, "q_proj", "A")
    edit_tensors(directory, lambda t: t.update({name: t[name].to(torch.float64)}))
    assert refusal(directory, llama).field == name


def test_refuses_a_half_pair_and_a_module_outside_target_modules(tmp_path, llama):
    directory = adapter(tmp_path, llama)
    name = adapter_tensor(0, "q_proj", "B")
    edit_tensors(directory, lambda t: t.pop(name))
    error = refusal(directory, llama)
    assert error.field == adapter_tensor(0, "q_proj", "A") and "lora_B" in error.problem

    other = adapter(tmp_path / "k", llama)
    extra = adapter_tensor(0, "k_proj", "A")
    edit_tensors(other, lambda t: t.update({extra: torch.zeros(4, 64)}))
    assert refusal(other, llama).field == extra


def test_refuses_an_embedding_tensor_by_name(tmp_path, llama):
    directory = adapter(tmp_path, llama)
    name = "base_model.model.model.embed_tokens.lora_embedding_A"
    edit_tensors(directory, lambda t: t.update({name: torch.zeros(4, 512)}))
    assert refusal(directory, llama).field == name


def test_refuses_lora_on_a_mixture_of_experts_mlp(tmp_path, tiny_checkpoints):
    base = tiny_checkpoints["qwen3_moe"].directory
    config = read_config(base)
    directory = tmp_path / "moe"
    directory.mkdir()
    name = adapter_tensor(0, "down_proj", "A")
    save_file({name: torch.zeros(4, 128), name.replace("lora_A", "lora_B"): torch.zeros(64, 4)},
              str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["down_proj"]}))
    with pytest.raises(CheckpointError) as caught:
        check_lora_weights(directory, read_lora_config(directory, config), config)
    assert caught.value.field == name and "mixture of experts" in caught.value.problem
