"""Checkpoints the Llama family refuses, each with a CheckpointError naming the file and the field or
tensor; and the spellings of a config it accepts (transformers 4 and 5, sliding windows per layer,
sharded weights)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.models.llama_config import (
    CheckpointError,
    LinearRopeScaling,
    LlamaFamilyConfig,
    YarnRopeScaling,
)
from services.worker.models.llama_weights import load_llama_family, read_config
from tests.support.hf_checkpoints import save_tiny_checkpoint


def copy_of(tiny_checkpoints, family: str, tmp_path: Path) -> Path:
    directory = tmp_path / family
    shutil.copytree(tiny_checkpoints[family].directory, directory)
    return directory


def edit_config(directory: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def refusal(directory: Path, **kwargs: Any) -> CheckpointError:
    with pytest.raises(CheckpointError) as caught:
        load_llama_family(directory, **kwargs)
    return caught.value


def llama_config(**fields: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, **fields}


# --- config.json ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "field", "says"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures[0]",
     "supported: Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, GraniteForCausalLM, "
     "LlamaForCausalLM, LlamaModel, MistralForCausalLM, MistralModel, MixtralForCausalLM, Olmo2ForCausalLM, "
     "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2Model, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3Model, "
     "Qwen3MoeForCausalLM, SmolLM3ForCausalLM"),
    ({"architectures": ["Olmo3ForCausalLM"]}, "architectures[0]", "Olmo2ForCausalLM"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures[0]", "supported: Gemma2ForCausalLM, Gemma3"),
    ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}, "attention_bias", "supported: false"),
    ({"architectures": []}, "architectures", "supported: Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForCond"),
    ({"rope_scaling": {"type": "su", "factor": 4.0}}, "rope_scaling.type", "supported: default, linear, llama3, yarn"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type", "supported: default, linear"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type", "llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "rope_scaling.original_max_position_embeddings", "needs a number > 0"),
    ({"partial_rotary_factor": 0.5, "rope_scaling": None}, "partial_rotary_factor", "supported: 1.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "rope_parameters.partial_rotary_factor", "supported: 1.0"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                             "long_factor": [1.0] * 8}},
     "rope_scaling.type", "supported: default, linear, llama3, yarn"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor", "needs a finite number > 0, got None"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -4.0}}, "rope_scaling.factor", "got -4.0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 6.5}},
     "rope_scaling.original_max_position_embeddings", "must be an integer > 0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": "no"}}, "rope_scaling.truncate",
     "must be true or false"),
    ({"architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1, 2]}, "no_rope_layers", "0s and 1s"),
    ({"architectures": ["SmolLM3ForCausalLM"], "no_rope_layers": [1]}, "no_rope_layers", "a list of 2"),
    ({"hidden_act": "gelu"}, "hidden_act", "supported: silu"),
    ({"attention_bias": True}, "attention_bias", "supported: false"),
    ({"mlp_bias": True}, "mlp_bias", "supported: false"),
    ({"quantization_config": {"quant_method": "eetq"}}, "quantization_config.quant_method",
     "'eetq' is not supported; supported: fp8, compressed-tensors, awq, gptq"),
    ({"torch_dtype": "float64"}, "torch_dtype", "supported: float32, float16, bfloat16"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", "does not divide num_attention_heads 4"),
    ({"vocab_size": None}, "vocab_size", "is required"),
    ({"num_hidden_layers": 10**12}, "num_hidden_layers", "is more than 1024"),  # per-layer tables come first
    ({"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 10**12}, "num_hidden_layers", "more than 1024"),
    ({"hidden_size": "64"}, "hidden_size", "must be a positive int"),
])
def test_unsupported_or_malformed_config_names_the_field(fields, field, says):
    with pytest.raises(CheckpointError) as caught:
        LlamaFamilyConfig.from_hf(llama_config(**fields), file="dir/config.json")
    assert (caught.value.file, caught.value.field) == ("dir/config.json", field)
    assert says in str(caught.value) and str(caught.value).startswith(f"dir/config.json: {field}: ")


def test_transformers_4_and_5_spellings_of_llama3_rope_read_alike():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = LlamaFamilyConfig.from_hf(llama_config(rope_theta=5e5, rope_scaling={"type": "llama3", **scaling}))
    new = LlamaFamilyConfig.from_hf(llama_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, **scaling}))
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling is not None
    default = LlamaFamilyConfig.from_hf(llama_config(rope_theta=5e5, rope_scaling=None))
    assert default.rope_scaling is None and default.rope_theta == 5e5


def test_yarn_reads_its_fields_as_transformers_does():
    """Qwen2.5's long-context setting; the factor from the context ratio when absent; the attention
    factor from mscale / mscale_all_dim (DeepSeek's spelling) or given outright; a 0 beta is the default."""
    qwen25 = llama_config(max_position_embeddings=131072, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    scaling = LlamaFamilyConfig.from_hf(qwen25).rope_scaling
    assert isinstance(scaling, YarnRopeScaling)
    assert (scaling.factor, scaling.original_max_position_embeddings, scaling.beta_fast, scaling.beta_slow) == (
        4.0, 32768, 32.0, 1.0)
    assert scaling.attention_factor == 0.1 * math.log(4.0) + 1.0
    ratio = LlamaFamilyConfig.from_hf(llama_config(max_position_embeddings=256, rope_scaling={
        "rope_type": "yarn", "original_max_position_embeddings": 64, "beta_fast": 0})).rope_scaling
    assert isinstance(ratio, YarnRopeScaling) and (ratio.factor, ratio.beta_fast) == (4.0, 32.0)
    deepseek = LlamaFamilyConfig.from_hf(llama_config(rope_scaling={
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0})).rope_scaling
    assert isinstance(deepseek, YarnRopeScaling) and deepseek.attention_factor == 1.0
    given = LlamaFamilyConfig.from_hf(llama_config(rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.5}))
    assert isinstance(given.rope_scaling, YarnRopeScaling) and given.rope_scaling.attention_factor == 1.5


def test_sliding_windows_are_read_per_layer_and_one_covering_the_sequence_is_none():
    mistral = llama_config(architectures=["MistralForCausalLM"], sliding_window=128)
    assert LlamaFamilyConfig.from_hf(mistral).layer_windows == (128, 128)  # every layer slides
    assert LlamaFamilyConfig.from_hf(mistral, max_seq_len=128).layer_windows == ()  # covers the sequence
    assert LlamaFamilyConfig.from_hf({**mistral, "sliding_window": None}).layer_windows == ()
    with pytest.raises(CheckpointError, match="sliding_window: must be a positive int or null"):
        LlamaFamilyConfig.from_hf({**mistral, "sliding_window": 0})

    # Qwen2 (and Qwen3, SmolLM3) slide the layers from max_window_layers on, with use_sliding_window.
    qwen = llama_config(architectures=["Qwen2ForCausalLM"], sliding_window=128, max_window_layers=0)
    assert LlamaFamilyConfig.from_hf({**qwen, "use_sliding_window": False}).layer_windows == ()
    assert LlamaFamilyConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2}).layer_windows == ()
    assert LlamaFamilyConfig.from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1}).layer_windows \
        == (0, 128)
    assert LlamaFamilyConfig.from_hf({**qwen, "use_sliding_window": True}).layer_windows == (128, 128)
    # transformers 5's layer_types say it for every architecture.
    typed = LlamaFamilyConfig.from_hf({**qwen, "layer_types": ["full_attention", "sliding_attention"]})
    assert typed.layer_windows == (0, 128) and typed.window_of(1) == 128
    with pytest.raises(CheckpointError, match="layer_types: must be a list of 2"):
        LlamaFamilyConfig.from_hf({**qwen, "layer_types": ["sliding_attention"]})
    phi3 = llama_config(architectures=["Phi3ForCausalLM"], sliding_window=127)  # Phi-3-mini-4k's 2047, scaled
    assert LlamaFamilyConfig.from_hf(phi3).layer_windows == (127, 127)

    smollm3 = llama_config(architectures=["SmolLM3ForCausalLM"], sliding_window=128)
    assert LlamaFamilyConfig.from_hf(smollm3).layer_windows == ()  # no use_sliding_window: no window
    assert LlamaFamilyConfig.from_hf({**smollm3, "use_sliding_window": True}).layer_windows == (128, 128)
    assert LlamaFamilyConfig.from_hf({**smollm3, "no_rope_layers": [0, 1]}).nope_layers == (0,)
    assert LlamaFamilyConfig.from_hf({**smollm3, "num_hidden_layers": 8}).nope_layers == (3, 7)  # every 4th
    assert LlamaFamilyConfig.from_hf(llama_config(sliding_window=16)).layer_windows == ()  # Llama has none
    with pytest.raises(CheckpointError, match="max_position_embeddings"):
        LlamaFamilyConfig.from_hf(llama_config(), max_seq_len=257)


def test_gemma_reads_its_pattern_scalings_softcaps_and_local_rope():
    gemma3 = llama_config(architectures=["Gemma3ForCausalLM"], num_hidden_layers=12, head_dim=16, sliding_window=32,
                          rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256,
                          rope_scaling={"rope_type": "linear", "factor": 8.0}, hidden_activation="gelu_pytorch_tanh")
    config = LlamaFamilyConfig.from_hf(gemma3)  # transformers 4's spelling, Gemma 3 4B's shape
    assert config.layer_windows == (32,) * 5 + (0,) + (32,) * 5 + (0,)  # every 6th layer is full
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling.factor) == (1000000.0, 10000.0, 8.0)
    assert config.attention_scale == 1 / 16 and config.qk_norm == "head" and config.norm_plus_one
    assert (config.pre_norms, config.post_norms, config.embedding_normalizer) == (True, True, True)
    assert (config.attention_softcap, config.final_logit_softcap) == (0.0, 0.0)
    assert LlamaFamilyConfig.from_hf({**gemma3, "sliding_window_pattern": 3}).layer_windows[:3] == (32, 32, 0)
    unsaid = {key: value for key, value in gemma3.items() if key not in ("rope_theta", "rope_local_base_freq")}
    assert (LlamaFamilyConfig.from_hf(unsaid).rope_theta, LlamaFamilyConfig.from_hf(unsaid).local_rope_theta) == (
        1000000.0, 10000.0)  # Gemma3TextConfig's defaults
    gemma2 = llama_config(architectures=["Gemma2ForCausalLM"], head_dim=16, sliding_window=32,
                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=144)
    config = LlamaFamilyConfig.from_hf(gemma2)
    assert config.layer_windows == (32, 0) and config.local_rope_theta is None and not config.qk_norm
    assert (config.attention_softcap, config.final_logit_softcap, config.attention_scale) == (50.0, 30.0, 144 ** -0.5)
    for field, value, says in [("hidden_activation", "silu", "supported: gelu_pytorch_tanh"),
                               ("attn_logit_softcapping", -1.0, "finite number > 0"),
                               ("use_bidirectional_attention", True, "embedding model")]:
        with pytest.raises(CheckpointError, match=says) as caught:
            LlamaFamilyConfig.from_hf({**gemma2, field: value})
        assert caught.value.field == field
    with pytest.raises(CheckpointError, match="rope_parameters.sliding_attention.rope_type"):
        LlamaFamilyConfig.from_hf({**gemma3, "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "linear", "factor": 2.0}}})


def test_unsupported_architecture_in_a_directory_names_config_json(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    edit_config(directory, lambda c: c.update(architectures=["OlmoeForCausalLM"]))
    error = refusal(directory)
    assert (error.file, error.field) == (str(directory / "config.json"), "architectures[0]")


def test_missing_or_broken_config_json_is_refused(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    (directory / "config.json").write_text("{not json")
    assert "not readable JSON" in str(refusal(directory))
    (directory / "config.json").write_text("[" * 100_000)  # deeper than json's recursion: RecursionError before
    assert "not readable JSON" in str(refusal(directory))
    (directory / "config.json").unlink()
    assert "missing from the checkpoint directory" in str(refusal(directory))


# --- safetensors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("corrupt", [
    lambda data: data[: len(data) // 2],  # truncated: the header names bytes the file lacks
    lambda data: b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all",
    lambda data: b"\xff" * 8 + data[8:],  # a header length past the end of the file
    lambda data: (100_000).to_bytes(8, "little") + b"[" * 100_000,  # nested deeper than any JSON reader recurses
])
def test_corrupt_safetensors_header_names_the_file(tiny_checkpoints, tmp_path, corrupt):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(corrupt(weights.read_bytes()))
    error = refusal(directory)
    assert (error.file, error.field) == (str(weights), "header")
    assert "not a readable safetensors file" in str(error)


def test_tensor_of_the_wrong_shape_names_file_tensor_and_both_shapes(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "qwen2", tmp_path)
    weights = directory / "model.safetensors"
    edit_tensors(weights, lambda t: t.update({"model.layers.1.self_attn.k_proj.bias": torch.zeros(16)}))
    error = refusal(directory)
    assert (error.file, error.field) == (str(weights), "model.layers.1.self_attn.k_proj.bias")
    assert "shape [16] but config.json implies [32]" in str(error)


@pytest.mark.parametrize(("dtype", "says"), [
    (torch.float64, "dtype F64 is not supported; supported: F32, F16, BF16"),
    (torch.int32, "dtype I32 is not supported"),
    (torch.bfloat16, "dtype BF16 (bfloat16) but config.json declares float32"),
])
def test_tensor_of_the_wrong_dtype_names_file_and_tensor(tiny_checkpoints, tmp_path, dtype, says):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    weights = directory / "model.safetensors"
    name = "model.layers.0.mlp.down_proj.weight"
    edit_tensors(weights, lambda t: t.update({name: t[name].to(dtype)}))
    error = refusal(directory)
    assert (error.file, error.field) == (str(weights), name) and says in str(error)


def test_mixed_storage_dtypes_are_refused_when_the_config_declares_none(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    edit_config(directory, lambda c: c.pop("dtype", None))
    name = "model.norm.weight"
    edit_tensors(directory / "model.safetensors", lambda t: t.update({name: t[name].half()}))
    error = refusal(directory)
    assert error.field == name and "one storage dtype per checkpoint" in str(error)


def test_missing_and_unexpected_tensors_are_named(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    weights = directory / "model.safetensors"
    edit_tensors(weights, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    error = refusal(directory)
    assert error.field == "model.layers.1.post_attention_layernorm.weight" and "missing" in str(error)

    directory = copy_of(tiny_checkpoints, "llama_tied", tmp_path / "second")
    weights = directory / "model.safetensors"
    edit_tensors(weights, lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}))
    error = refusal(directory)
    assert (error.file, error.field) == (str(weights), "model.layers.2.input_layernorm.weight")
    assert "unexpected tensor for LlamaForCausalLM (2 layers" in str(error)

    # Qwen3's per-head norms: one missing is named; a Qwen2 config over Qwen3's weights finds them unexpected.
    directory = copy_of(tiny_checkpoints, "qwen3", tmp_path / "third")
    weights = directory / "model.safetensors"
    edit_tensors(weights, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"))
    error = refusal(directory)
    assert error.field == "model.layers.0.self_attn.k_norm.weight" and "missing" in str(error)
    directory = copy_of(tiny_checkpoints, "qwen3", tmp_path / "fourth")
    edit_config(directory, lambda c: c.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    error = refusal(directory)
    assert error.field.endswith("_norm.weight") and "qk_norm=''" in str(error)


def test_a_directory_without_weights_is_refused(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "llama", tmp_path)
    (directory / "model.safetensors").unlink()
    error = refusal(directory)
    assert error.field == "model.safetensors" and "neither model.safetensors nor" in str(error)


def test_sharded_weights_load_and_their_index_is_checked(tmp_path):
    reference = save_tiny_checkpoint(tmp_path, "llama", seed=3)
    shutil.rmtree(tmp_path)
    reference.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ids = torch.tensor([[5, 9, 300, 17, 2, 44]])
    with torch.inference_mode():
        torch.testing.assert_close(load_llama_family(tmp_path)(ids), reference(ids).logits, rtol=0.0, atol=2e-4)

    moved = "model.layers.0.mlp.up_proj.weight"
    wrong_shard = next(f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][moved])
    index["weight_map"][moved] = wrong_shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    error = refusal(tmp_path)
    assert (error.file, error.field) == (str(tmp_path / wrong_shard), moved)
    assert "listed in model.safetensors.index.json but not in the file" in str(error)


def test_read_config_checks_without_touching_weights(tiny_checkpoints):
    config = read_config(tiny_checkpoints["mistral"].directory, max_seq_len=100)
    assert config.max_seq_len == 100 and config.architecture == "MistralForCausalLM"


# The config.json files of released checkpoints (transformers 4 spellings), as users bring them.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
GRANITE_3_3_8B = {  # the fields that set it apart; the rest as Llama's
    "architectures": ["GraniteForCausalLM"], "attention_bias": False, "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12.0, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12800,
    "logits_scaling": 16.0, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "granite",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8, "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "vocab_size": 49159,
}
MISTRAL_7B_V0_1 = {
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}


GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 262144,
}
# Gemma 3 4B (vision + text; transformers 4.50): text_config gives only what differs from Gemma3TextConfig.
GEMMA_3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999, "eoi_token_index": 256000,
    "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}
GEMMA_2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "use_cache": True, "vocab_size": 256000,
}


def test_released_checkpoints_configs_read_as_their_architecture():
    llama = LlamaFamilyConfig.from_hf(LLAMA_3_1_8B, max_seq_len=8192)
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_size, llama.storage_dtype) == (
        32, 32, 8, 128, "bfloat16")
    assert llama.rope_scaling is not None and llama.rope_scaling.original_max_position_embeddings == 8192

    qwen = LlamaFamilyConfig.from_hf(QWEN2_5_0_5B)  # use_sliding_window false: its window is no window
    assert qwen.qkv_bias and qwen.tie_word_embeddings and qwen.head_size == 64 and qwen.max_seq_len == 32768

    qwen3 = LlamaFamilyConfig.from_hf(QWEN3_0_6B)  # head_dim 128 over hidden 1024 / 16 heads (64)
    assert qwen3.qk_norm == "head" and not qwen3.qkv_bias and qwen3.tie_word_embeddings
    assert (qwen3.head_size, qwen3.num_heads * qwen3.head_size, qwen3.d_model) == (128, 2048, 1024)
    assert qwen3.rope_theta == 1e6 and qwen3.rope_scaling is None and qwen3.max_seq_len == 40960

    granite = LlamaFamilyConfig.from_hf(GRANITE_3_3_8B)
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.logits_scaling) == (12.0, 0.22, 16.0)
    assert granite.attention_scale == 0.0078125 and llama.attention_scale == 1 / math.sqrt(128)
    # Granite's keys mean nothing to another architecture's config (transformers ignores them too).
    assert LlamaFamilyConfig.from_hf({**LLAMA_3_1_8B, "logits_scaling": 16.0}, max_seq_len=8192) == llama
    with pytest.raises(CheckpointError, match="logits_scaling: must be a finite number > 0"):
        LlamaFamilyConfig.from_hf({**GRANITE_3_3_8B, "logits_scaling": 0})

    mistral = LlamaFamilyConfig.from_hf(MISTRAL_7B_V0_1)
    assert mistral.layer_windows == (4096,) * 32 and mistral.max_seq_len == 32768 and not mistral.qkv_bias
    assert LlamaFamilyConfig.from_hf(MISTRAL_7B_V0_1, max_seq_len=4096).layer_windows == ()  # it covers all

    gemma3 = LlamaFamilyConfig.from_hf(GEMMA_3_1B)  # tied by Gemma's default: the config does not say
    assert gemma3.tie_word_embeddings and gemma3.head_size == 256 and gemma3.num_kv_heads == 1
    assert gemma3.layer_windows == ((512,) * 5 + (0,)) * 4 + (512,) * 2 and gemma3.local_rope_theta == 10000
    gemma2 = LlamaFamilyConfig.from_hf(GEMMA_2_2B)
    assert gemma2.tie_word_embeddings and gemma2.layer_windows == (4096, 0) * 13
    assert (gemma2.attention_softcap, gemma2.final_logit_softcap, gemma2.attention_scale) == (50.0, 30.0, 1 / 16)

    gemma3_4b = LlamaFamilyConfig.from_hf(GEMMA_3_4B_IT)  # the rest from Gemma3TextConfig's defaults
    assert (gemma3_4b.architecture, gemma3_4b.multimodal, gemma3_4b.storage_dtype) == (
        "Gemma3ForConditionalGeneration", True, "bfloat16")
    assert (gemma3_4b.vocab_size, gemma3_4b.d_model, gemma3_4b.d_ff, gemma3_4b.num_layers) == (262208, 2560, 10240, 34)
    assert (gemma3_4b.num_heads, gemma3_4b.num_kv_heads, gemma3_4b.head_size) == (8, 4, 256)
    assert (gemma3_4b.max_position_embeddings, gemma3_4b.norm_eps, gemma3_4b.attention_scale) == (131072, 1e-6, 1 / 16)
    assert (gemma3_4b.rope_theta, gemma3_4b.local_rope_theta, gemma3_4b.rope_scaling) == (
        1e6, 1e4, LinearRopeScaling(8.0))
    assert gemma3_4b.layer_windows == ((1024,) * 5 + (0,)) * 5 + (1024,) * 4
    assert gemma3_4b.tie_word_embeddings and gemma3_4b.activation == "gelu_pytorch_tanh"
    assert (gemma3_4b.attention_softcap, gemma3_4b.final_logit_softcap, gemma3_4b.qk_norm) == (0.0, 0.0, "head")
    # Gemma3ForCausalLM's reading of the same text config, with what the defaults supply written out.
    text = {**GEMMA_3_4B_IT["text_config"], "architectures": ["Gemma3ForCausalLM"], "torch_dtype": "bfloat16",
            "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "max_position_embeddings": 131072, "rope_theta": 1e6}
    assert LlamaFamilyConfig.from_hf(text) == dataclasses.replace(
        gemma3_4b, architecture="Gemma3ForCausalLM", multimodal=False)


def edited(config: dict[str, Any], text: dict[str, Any] | None = None, drop: str = "", **top: Any) -> dict[str, Any]:
    """`config` with `top` over its top level and `text` over its text_config, less text_config's `drop`."""
    text_config = {k: v for k, v in {**config["text_config"], **(text or {})}.items() if k != drop}
    return {**config, **top, "text_config": text_config}


@pytest.mark.parametrize(("config", "field", "says"), [
    (edited(GEMMA_3_4B_IT, drop="hidden_size"), "text_config.hidden_size", "is required"),
    (edited(GEMMA_3_4B_IT, {"sliding_window": 0}), "text_config.sliding_window", "must be a positive int or null"),
    (edited(GEMMA_3_4B_IT, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
     "text_config.rope_scaling.rope_type", "supported: default, linear, llama3, yarn"),
    (edited(GEMMA_3_4B_IT, {"num_key_value_heads": 3}), "text_config.num_key_value_heads", "does not divide"),
    (edited(GEMMA_3_4B_IT, {"torch_dtype": "float64"}), "text_config.torch_dtype", "supported: float32"),
    (edited(GEMMA_3_4B_IT, torch_dtype="int8"), "torch_dtype", "supported: float32"),
    (edited(GEMMA_3_4B_IT, quantization_config={"quant_method": "bitsandbytes"}), "quantization_config.quant_method",
     "'bitsandbytes' is not supported"),
    (edited(GEMMA_3_4B_IT, {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}),
     "text_config.quantization_config.fmt", "supported: e4m3"),
    (edited(GEMMA_3_4B_IT, {"tie_word_embeddings": False}, tie_word_embeddings=True), "tie_word_embeddings",
     "transformers 4 and 5 would read this checkpoint differently"),
    ({**GEMMA_3_4B_IT, "text_config": None}, "text_config", "must be an object"),
    # The defaults are the vision checkpoint's: a flat Gemma 3 config still states its shape.
    ({**GEMMA_3_1B, "vocab_size": None}, "vocab_size", "is required"),
])
def test_a_vision_checkpoints_text_config_errors_name_the_field_inside_it(config, field, says):
    with pytest.raises(CheckpointError) as caught:
        LlamaFamilyConfig.from_hf(config, file="dir/config.json")
    assert (caught.value.file, caught.value.field) == ("dir/config.json", field) and says in str(caught.value)
    assert str(caught.value).startswith(f"dir/config.json: {field}: ")


def test_a_vision_checkpoints_dtype_is_read_from_text_config_or_the_top_level():
    assert LlamaFamilyConfig.from_hf(edited(GEMMA_3_4B_IT, torch_dtype=None)).storage_dtype is None
    assert LlamaFamilyConfig.from_hf(edited(GEMMA_3_4B_IT, {"dtype": "float32"})).storage_dtype == "float32"
    top_level_5 = edited(GEMMA_3_4B_IT, torch_dtype=None, dtype="float16")  # transformers 5's spelling
    assert LlamaFamilyConfig.from_hf(top_level_5).storage_dtype == "float16"
