"""Mixture-of-experts checkpoints (Mixtral, Qwen2-MoE, Qwen3-MoE): released configs read as
transformers reads them, what is refused (a CheckpointError naming the file and the field or tensor),
and both on-disk layouts of the experts: per expert as released, and stacked as transformers 5 can
save them. Their logits against transformers are test_llama_family's (FAMILIES holds them)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from services.worker.models.llama_config import CheckpointError, ExpertsConfig, LlamaFamilyConfig
from services.worker.models.llama_weights import load_llama_family
from services.worker.repository.hf_import import weight_bytes
from tests.unit.worker.models.test_llama_checkpoint_errors import copy_of, edit_config, edit_tensors, refusal
from tests.unit.worker.models.test_llama_family import LOGITS_TOLERANCE, random_ids

# The config.json files of released checkpoints (transformers 4 spellings), as users bring them.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_CODER_30B_A3B = {**QWEN3_30B_A3B, "max_position_embeddings": 262144, "rope_theta": 10000000.0}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
    "model_type": "qwen2_moe", "moe_intermediate_size": 1408, "norm_topk_prob": False, "num_attention_heads": 16,
    "num_experts": 60, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 16,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_released_mixture_of_experts_configs_read_as_transformers_builds_them():
    qwen3 = LlamaFamilyConfig.from_hf(QWEN3_30B_A3B)
    assert qwen3.experts == ExpertsConfig(num_experts=128, top_k=8, d_ff=768, layers=tuple(range(48)),
                                          renormalize=True)
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_size, qwen3.num_kv_heads, qwen3.layer_windows) == (
        "head", False, 128, 4, ())
    coder = LlamaFamilyConfig.from_hf(QWEN3_CODER_30B_A3B)
    assert coder.experts == qwen3.experts and (coder.max_seq_len, coder.rope_theta) == (262144, 1e7)

    mixtral = LlamaFamilyConfig.from_hf(MIXTRAL_8X7B)  # every layer sparse; experts of intermediate_size
    assert mixtral.experts == ExpertsConfig(num_experts=8, top_k=2, d_ff=14336, layers=tuple(range(32)),
                                            renormalize=True, float32_weights=True)
    assert (mixtral.qkv_bias, mixtral.qk_norm, mixtral.layer_windows, mixtral.rope_theta) == (False, "", (), 1e6)
    windowed = LlamaFamilyConfig.from_hf({**MIXTRAL_8X7B, "sliding_window": 4096})  # as Mistral's, every layer
    assert windowed.layer_windows == (4096,) * 32

    qwen2 = LlamaFamilyConfig.from_hf(QWEN1_5_MOE_A2_7B)  # its sliding_window is off (use_sliding_window)
    assert qwen2.experts == ExpertsConfig(num_experts=60, top_k=4, d_ff=1408, layers=tuple(range(24)),
                                          renormalize=False, shared_d_ff=5632)
    assert qwen2.qkv_bias and qwen2.layer_windows == () and qwen2.d_ff == 5632

    # Every expert is held (no expert parallelism): the parameter counts these models are known by.
    billions = [weight_bytes(c) / 4 / 1e9 for c in (qwen3, mixtral, qwen2)]
    assert billions == [pytest.approx(30.5, rel=0.01), pytest.approx(46.7, rel=0.01), pytest.approx(14.3, rel=0.01)]


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    def layers(**fields: Any) -> tuple[int, ...] | None:
        experts = LlamaFamilyConfig.from_hf({**QWEN3_30B_A3B, "num_hidden_layers": 4, **fields}).experts
        return None if experts is None else experts.layers

    assert layers() == (0, 1, 2, 3)
    assert layers(decoder_sparse_step=2) == (1, 3)  # every second layer, counted from 1
    assert layers(mlp_only_layers=[0, 2]) == (1, 3)
    assert layers(decoder_sparse_step=2, mlp_only_layers=[1]) == (3,)
    assert layers(mlp_only_layers=None) == (0, 1, 2, 3)
    assert layers(mlp_only_layers=[0, 1, 2, 3]) is None  # every layer dense: a dense Qwen3 in effect


def test_the_routers_training_settings_and_transformers_5s_spelling_read_alike():
    """output_router_logits, router_aux_loss_coef and router_jitter_noise are training's (the load-balancing
    loss, and noise multiplied in only while training): ignored. transformers 5 writes Qwen3-MoE's
    num_experts as num_local_experts."""
    trained = {"output_router_logits": True, "router_aux_loss_coef": 0.5, "router_jitter_noise": 0.1}
    assert LlamaFamilyConfig.from_hf({**MIXTRAL_8X7B, **trained}) == LlamaFamilyConfig.from_hf(MIXTRAL_8X7B)
    assert LlamaFamilyConfig.from_hf({**QWEN3_30B_A3B, **trained}) == LlamaFamilyConfig.from_hf(QWEN3_30B_A3B)
    spelled_5 = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert LlamaFamilyConfig.from_hf(spelled_5) == LlamaFamilyConfig.from_hf(QWEN3_30B_A3B)
    assert LlamaFamilyConfig.from_hf({**QWEN3_30B_A3B, "num_local_experts": 128}).experts.num_experts == 128


def without(config: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != key}


@pytest.mark.parametrize(("config", "field", "says"), [
    ({**QWEN3_30B_A3B, "num_experts_per_tok": 129}, "num_experts_per_tok", "129 exceeds the 128 experts"),
    (without(QWEN3_30B_A3B, "num_experts"), "num_experts", "is required"),
    (without(MIXTRAL_8X7B, "num_local_experts"), "num_local_experts", "is required"),
    ({**QWEN3_30B_A3B, "num_local_experts": 64}, "num_local_experts", "64, but num_experts is 128"),
    ({**QWEN3_30B_A3B, "num_experts": 0}, "num_experts", "must be a positive int"),
    # The expected tensors are listed per expert before any is read: a config saying 10**12 must not list them.
    ({**QWEN3_30B_A3B, "num_experts": 10**12, "num_experts_per_tok": 2}, "num_experts", "is more than 4096"),
    ({**MIXTRAL_8X7B, "num_local_experts": 10**9}, "num_local_experts", "is more than 4096"),
    (without(QWEN3_30B_A3B, "moe_intermediate_size"), "moe_intermediate_size", "is required"),
    ({**QWEN3_30B_A3B, "mlp_only_layers": [48]}, "mlp_only_layers", "layer indices below num_hidden_layers 48"),
    ({**QWEN3_30B_A3B, "mlp_only_layers": "all"}, "mlp_only_layers", "must be a list of layer indices"),
    ({**QWEN3_30B_A3B, "decoder_sparse_step": 0}, "decoder_sparse_step", "must be a positive int"),
    ({**QWEN3_30B_A3B, "norm_topk_prob": "yes"}, "norm_topk_prob", "must be true or false"),
    ({**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window",
     "true is not supported for a Qwen mixture of experts; supported: false"),
    ({**QWEN3_30B_A3B, "attention_bias": True}, "attention_bias", "supported: false"),
    ({**QWEN1_5_MOE_A2_7B, "qkv_bias": False}, "qkv_bias", "supported: true"),
    ({**QWEN1_5_MOE_A2_7B, "shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size",
     "must be a positive int"),
    ({**MIXTRAL_8X7B, "num_experts_per_tok": 0}, "num_experts_per_tok", "must be a positive int"),
    ({**MIXTRAL_8X7B, "hidden_act": "gelu"}, "hidden_act", "supported: silu"),
    ({**MIXTRAL_8X7B, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}},
     "quantization_config.version", "'gemv' is not supported"),
])
def test_a_mixture_of_experts_config_we_do_not_compute_is_refused_naming_the_field(config, field, says):
    with pytest.raises(CheckpointError) as caught:
        LlamaFamilyConfig.from_hf(config, file="dir/config.json")
    assert (caught.value.file, caught.value.field) == ("dir/config.json", field)
    assert says in str(caught.value) and str(caught.value).startswith(f"dir/config.json: {field}: ")


# --- weights -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("family", "name", "shape", "implied"), [
    ("qwen3_moe", "model.layers.0.mlp.experts.3.up_proj.weight", (16, 64), [32, 64]),
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight", (4, 64), [8, 64]),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.5.w2.weight", (32, 64), [64, 32]),
    ("qwen2_moe", "model.layers.1.mlp.shared_expert_gate.weight", (64,), [1, 64]),
])
def test_an_expert_tensor_of_the_wrong_shape_is_refused_naming_it(tiny_checkpoints, tmp_path, family, name, shape,
                                                                   implied):
    directory = copy_of(tiny_checkpoints, family, tmp_path)
    weights = directory / "model.safetensors"
    edit_tensors(weights, lambda t: t.update({name: torch.zeros(shape)}))
    error = refusal(directory)
    assert (error.file, error.field) == (str(weights), name)
    assert f"shape {list(shape)} but config.json implies {implied}" in str(error)


def test_missing_and_unexpected_expert_tensors_are_named(tiny_checkpoints, tmp_path):
    directory = copy_of(tiny_checkpoints, "mixtral", tmp_path / "missing")
    edit_tensors(directory / "model.safetensors", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.7.w3.weight"))
    error = refusal(directory)
    assert error.field == "model.layers.1.block_sparse_moe.experts.7.w3.weight" and "missing" in str(error)

    # A config that makes the dense layer sparse finds its dense MLP unexpected, and says what it expects.
    directory = copy_of(tiny_checkpoints, "qwen3_moe", tmp_path / "dense")
    edit_config(directory, lambda c: c.update(mlp_only_layers=[]))
    error = refusal(directory)
    assert error.field == "model.layers.1.mlp.down_proj.weight"
    assert "unexpected tensor for Qwen3MoeForCausalLM" in str(error)
    assert "8 experts on layers [0, 1] stored per expert" in str(error)


def stacked_copy(tiny_checkpoints, family: str, tmp_path, **save: Any):
    """`family`'s reference saved in transformers 5's stacked layout (save_original_format=False)."""
    directory = tmp_path / f"{family}-stacked"
    tiny_checkpoints[family].reference.save_pretrained(directory, save_original_format=False, **save)
    return directory


@pytest.mark.parametrize(("family", "save"), [("mixtral", {"max_shard_size": "200KB"}), ("qwen2_moe", {})])
def test_experts_stored_stacked_load_as_the_per_expert_ones(tiny_checkpoints, tmp_path, family, save):
    """Mixtral's stacked layout renames its block (mlp.*) and is sharded here (the layout is told from the
    index); Qwen2-MoE's keeps its shared expert's per-tensor names."""
    directory = stacked_copy(tiny_checkpoints, family, tmp_path, **save)
    if save:
        weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
        assert "model.layers.0.mlp.experts.gate_up_proj" in weight_map and len(set(weight_map.values())) > 1
    ids = torch.tensor([random_ids(40, seed=2)])
    with torch.inference_mode():
        got = load_llama_family(directory)(ids)
        torch.testing.assert_close(got, tiny_checkpoints[family].reference(ids).logits, **LOGITS_TOLERANCE)
        torch.testing.assert_close(got, load_llama_family(tiny_checkpoints[family].directory)(ids), rtol=0, atol=0)


def test_a_checkpoint_mixing_the_two_layouts_is_refused_naming_the_odd_tensor(tiny_checkpoints, tmp_path):
    directory = stacked_copy(tiny_checkpoints, "qwen3_moe", tmp_path)
    odd = "model.layers.0.mlp.experts.0.up_proj.weight"
    edit_tensors(directory / "model.safetensors", lambda t: t.update({odd: torch.zeros(32, 64)}))
    error = refusal(directory)
    assert error.field == odd and "stored stacked (mlp.experts.gate_up_proj)" in str(error)
