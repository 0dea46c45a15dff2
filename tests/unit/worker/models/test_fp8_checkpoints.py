"""FP8 checkpoints (fp8 block-wise as DeepSeek and Qwen3-FP8 publish them; compressed-tensors per tensor,
per channel and per block as llm-compressor writes them), dequantized at load: the weights equal the
dequantized checkpoint's exactly, so logits and greedy tokens are transformers' on that dense checkpoint
(test_llama_family's tolerance); and what is refused, naming the file and the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.models.fp8_config import PER_BLOCK, PER_CHANNEL, PER_TENSOR, Fp8Quantization
from services.worker.models.llama_config import CheckpointError, LlamaFamilyConfig
from services.worker.models.llama_weights import load_llama_family, read_config
from tests.support.fp8_checkpoints import Fp8Scheme, quantize_checkpoint
from tests.support.quantized_checkpoints import (
    QuantizedCheckpoint,
    assert_greedy_matches_transformers,
    assert_loads_as_the_dense_checkpoint,
    assert_logits_match_transformers,
    assert_memory_estimate_counts_the_dequantized_weights,
    make_checkpoints,
)
from tests.unit.worker.models.test_llama_checkpoint_errors import (
    edit_config,
    edit_tensors,
    llama_config,
    refusal,
)

BLOCK = Fp8Scheme("fp8")  # 32 x 48 blocks, ragged at the edges of the tiny 64 x 128 weights; lm_head left out
# The variants: fp8 block-wise on Llama and on Qwen3-MoE (its experts and routers quantized, beside a dense
# layer); compressed-tensors per tensor (with static activation scales), per channel (bfloat16 scales, as
# llm-compressor writes a bfloat16 model's; Mixtral's routers ignored) and per block (Qwen3, tied embeddings).
VARIANTS: dict[str, tuple[str, Fp8Scheme]] = {
    "fp8_llama": ("llama", BLOCK),
    "fp8_qwen3_moe": ("qwen3_moe", BLOCK),
    "ct_tensor_llama": ("llama", Fp8Scheme("compressed-tensors", "tensor", static_activations=True)),
    "ct_channel_mixtral": ("mixtral", Fp8Scheme("compressed-tensors", "channel", scale_dtype=torch.bfloat16,
                                                ignore=("lm_head", "re:.*block_sparse_moe.gate"))),
    "ct_block_qwen3": ("qwen3", Fp8Scheme("compressed-tensors", "block")),
}


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, QuantizedCheckpoint]:
    return make_checkpoints(tiny_checkpoints, tmp_path_factory, VARIANTS, quantize_checkpoint)


def test_each_variant_stores_float8_weights_and_its_scales(fp8_checkpoints):
    """The checkpoints are what they claim: Linear weights float8 beside scales, ignored modules not."""
    tensors = load_file(fp8_checkpoints["ct_channel_mixtral"].directory / "model.safetensors")
    assert tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight_scale"].shape == (64, 1)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32  # ignored
    assert tensors["lm_head.weight"].dtype == torch.float32
    assert "lm_head.weight" not in load_file(fp8_checkpoints["ct_block_qwen3"].directory / "model.safetensors")
    block = load_file(fp8_checkpoints["fp8_qwen3_moe"].directory / "model.safetensors")
    assert block["model.layers.0.mlp.experts.0.up_proj.weight_scale_inv"].shape == (1, 2)  # [32, 64] in 32 x 48
    assert block["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 3)  # [64, 128]: ragged columns
    assert block["model.layers.0.mlp.gate.weight"].dtype == torch.float8_e4m3fn
    assert read_config(fp8_checkpoints["ct_tensor_llama"].directory).quantization == Fp8Quantization(
        "compressed-tensors", "weight_scale", PER_TENSOR, static_activations=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_equal_the_dequantized_checkpoints_exactly(fp8_checkpoints, variant, dtype):
    """float32(weight) * scale, rounded once to the compute dtype: bit for bit what the dequantized
    float32 checkpoint loads as."""
    assert_loads_as_the_dense_checkpoint(fp8_checkpoints[variant], dtype)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_on_the_dequantized_weights(fp8_checkpoints, variant):
    assert_logits_match_transformers(fp8_checkpoints[variant])


def test_greedy_paged_decode_equals_transformers_generate_on_the_dequantized_weights(fp8_checkpoints):
    """A few prompts continuously batched through the paged path, on the mixture of experts (the FP8
    Qwen3 import's golden cases are this on a dense model; the weights test above makes the other
    variants the dense checkpoints test_llama_family decodes)."""
    ckpt = fp8_checkpoints["fp8_qwen3_moe"]
    assert_greedy_matches_transformers(ckpt, seed=200)


def test_the_memory_estimate_counts_the_dequantized_weights_not_the_file(fp8_checkpoints):
    assert_memory_estimate_counts_the_dequantized_weights(fp8_checkpoints["fp8_qwen3_moe"])


# --- refused ------------------------------------------------------------------------------------------

CT = Fp8Scheme("compressed-tensors", "channel").quantization_config()


def ct(**weights: Any) -> dict[str, Any]:
    group = CT["config_groups"]["group_0"]
    return {**CT, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **weights}}}}


@pytest.mark.parametrize(("quantization", "field", "says"), [
    ({"quant_method": "hqq"}, "quant_method", "'hqq' is not supported; supported: fp8, compressed-tensors, awq, gptq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method", "'bitsandbytes' is not supported"),
    ({"quant_method": "mxfp4"}, "quant_method", "'mxfp4' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt", "supported: e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size", "two positive ints, got None"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size", "got [128]"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt", "supported: float"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "tensor"}, "activation_scheme",
     "supported: dynamic, static"),
    ({**CT, "format": "pack-quantized"}, "format", "supported: float-quantized, naive-quantized"),
    ({**CT, "format": "int-quantized"}, "format", "'int-quantized' is not supported"),
    ({**CT, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, "kv_cache_scheme",
     "an FP8 KV cache is not supported"),
    ({**CT, "quantization_status": "frozen"}, "quantization_status", "supported: compressed"),
    ({**CT, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparsity_config", "supported: null, or format dense"),
    ({**CT, "transform_config": {"config_groups": {}}}, "transform_config", "supported: null"),
    (ct(type="int"), "config_groups.group_0.weights.type", "int8 and int4 schemes are not"),
    (ct(num_bits=4, type="float"), "config_groups.group_0.weights.num_bits", "supported: 8"),
    (ct(strategy="group", group_size=128), "config_groups.group_0.weights.strategy", "supported: tensor, channel, block"),
    (ct(symmetric=False), "config_groups.group_0.weights.symmetric", "supported: true"),
    (ct(strategy="block", block_structure=None), "config_groups.group_0.weights.block_structure", "got None"),
])
def test_unsupported_quantization_names_the_field(quantization, field, says):
    with pytest.raises(CheckpointError) as caught:
        LlamaFamilyConfig.from_hf(llama_config(quantization_config=quantization), file="dir/config.json")
    assert caught.value.field == f"quantization_config.{field}" and says in str(caught.value)


def test_the_schemes_read_as_the_checkpoints_publish_them():
    qwen3_fp8 = {"activation_scheme": "dynamic", "modules_to_not_convert": None, "fmt": "e4m3", "quant_method": "fp8",
                 "weight_block_size": [128, 128]}
    assert LlamaFamilyConfig.from_hf(llama_config(quantization_config=qwen3_fp8)).quantization == Fp8Quantization(
        "fp8", "weight_scale_inv", PER_BLOCK, (128, 128))
    channel = LlamaFamilyConfig.from_hf(llama_config(quantization_config=CT)).quantization
    assert channel == Fp8Quantization("compressed-tensors", "weight_scale", PER_CHANNEL)
    assert channel.scale_shapes((64, 128)) == ((64, 1),) and channel.input_scale_names == ()
    dense = {**CT, "sparsity_config": {"format": "dense", "sparsity_structure": "unstructured"}}
    assert LlamaFamilyConfig.from_hf(llama_config(quantization_config=dense)).quantization == channel


def _fp8_copy(fp8_checkpoints, variant: str, tmp_path: Path) -> Path:
    directory = tmp_path / variant
    shutil.copytree(fp8_checkpoints[variant].directory, directory)
    return directory


Q_PROJ = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(("edit", "tensor", "says"), [
    (lambda t: t.pop(f"{Q_PROJ}.weight_scale_inv"), f"{Q_PROJ}.weight", "F8_E4M3 without its scale "
     f"{Q_PROJ}.weight_scale_inv"),
    (lambda t: t.update({f"{Q_PROJ}.weight_scale_inv": torch.ones(2, 3)}), f"{Q_PROJ}.weight_scale_inv",
     "shape [2, 3] but one scale per 32 x 48 block of a [64, 64] weight takes [2, 2]"),
    (lambda t: t.update({f"{Q_PROJ}.weight": t[f"{Q_PROJ}.weight"].float().to(torch.float8_e5m2)}),
     f"{Q_PROJ}.weight", "dtype F8_E5M2 is not supported; supported: F32, F16, BF16, F8_E4M3 (quantized Linear"),
    (lambda t: t.update({f"{Q_PROJ}.weight": t[f"{Q_PROJ}.weight"].float()}), f"{Q_PROJ}.weight_scale_inv",
     "not stored as F8_E4M3 (a quantized weight's dtype"),
    (lambda t: t.update({f"{Q_PROJ}.weight_scale_inv": t[f"{Q_PROJ}.weight_scale_inv"].double()}),
     f"{Q_PROJ}.weight_scale_inv", "dtype F64 is not supported for a scale; supported: F32, BF16, F16"),
    (lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].to(torch.float8_e4m3fn)}),
     "model.embed_tokens.weight", "only Linear weights"),
    (lambda t: t.update({"model.norm.weight_scale_inv": torch.ones(1, 1)}), "model.norm.weight_scale_inv",
     "not a Linear weight"),
    (lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(16, 2)}), "lm_head.weight_scale_inv",
     "which is not stored as F8_E4M3"),
    (lambda t: t.update({f"{Q_PROJ}.input_scale": torch.ones(1)}), f"{Q_PROJ}.input_scale", "unexpected tensor"),
])
def test_a_broken_weight_and_scale_pair_names_the_tensor(fp8_checkpoints, tmp_path, edit, tensor, says):
    directory = _fp8_copy(fp8_checkpoints, "fp8_llama", tmp_path)
    edit_tensors(directory / "model.safetensors", edit)
    error = refusal(directory)
    assert (error.field, error.file) == (tensor, str(directory / "model.safetensors"))
    assert says in str(error)


def test_float8_weights_in_an_unquantized_checkpoint_are_refused_as_a_dtype(fp8_checkpoints, tmp_path):
    directory = _fp8_copy(fp8_checkpoints, "fp8_llama", tmp_path)
    edit_config(directory, lambda c: c.pop("quantization_config"))
    error = refusal(directory)
    assert "dtype F8_E4M3 is not supported; supported: F32, F16, BF16" in str(error)


def test_a_static_activation_scale_is_read_past_and_only_beside_a_float8_weight(fp8_checkpoints, tmp_path):
    directory = _fp8_copy(fp8_checkpoints, "ct_tensor_llama", tmp_path)
    assert "model.layers.1.mlp.up_proj.input_scale" in load_file(directory / "model.safetensors")
    edit_tensors(directory / "model.safetensors", lambda t: t.update({"lm_head.input_scale": torch.ones(1)}))
    error = refusal(directory)
    assert error.field == "lm_head.input_scale" and "not a F8_E4M3 weight" in str(error)


def test_fp8_static_activation_scales_are_read_past_under_either_name(fp8_checkpoints, tmp_path):
    """transformers writes an fp8 checkpoint's static scales as activation_scale, vLLM as input_scale."""
    directory = _fp8_copy(fp8_checkpoints, "fp8_llama", tmp_path)
    edit_config(directory, lambda c: c["quantization_config"].update(activation_scheme="static"))
    edit_tensors(directory / "model.safetensors", lambda t: t.update({
        f"{Q_PROJ}.activation_scale": torch.ones(()), "model.layers.1.mlp.up_proj.input_scale": torch.ones(1)}))
    got, expected = load_llama_family(directory).state_dict(), load_llama_family(
        fp8_checkpoints["fp8_llama"].dense).state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got.items())


def test_a_scale_in_another_shard_than_its_weight_is_paired(fp8_checkpoints, tmp_path):
    """Shards split where they split: a weight's scale may come in a later file than the weight."""
    ckpt = fp8_checkpoints["fp8_llama"]
    directory = _fp8_copy(fp8_checkpoints, "fp8_llama", tmp_path)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    save_file({n: t for n, t in tensors.items() if n not in scales}, directory / "a.safetensors")
    save_file(scales, directory / "b.safetensors")
    index = {"weight_map": {n: "b.safetensors" if n in scales else "a.safetensors" for n in tensors}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    got, expected = load_llama_family(directory).state_dict(), load_llama_family(ckpt.dense).state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got.items())
