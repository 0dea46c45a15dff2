"""AWQ and GPTQ checkpoints (packed as AutoAWQ's GEMM format and AutoGPTQ / GPTQModel's v1 and v2 formats
store them), dequantized at load: the weights equal `(q - z) * s` exactly, so logits and greedy tokens
are transformers' on a float32 checkpoint of those weights; act-order's permuted groups; and what is
refused, naming the file and the field or tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.models.awq_gptq_config import AWQ, GPTQ, IntQuantization
from services.worker.models.awq_gptq_weights import dequantize
from services.worker.models.fp8_config import Fp8Quantization
from services.worker.models.llama_config import CheckpointError, LlamaFamilyConfig
from services.worker.models.llama_weights import load_llama_family, read_config
from services.worker.models.quantization_config import describe
from tests.support.awq_gptq_checkpoints import IntScheme, quantize, quantize_checkpoint, stored_parts
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

AWQ_SCHEME = IntScheme("awq")  # 4-bit, groups of 32 inputs (the tiny weights have 32 to 128), lm_head left out
# AWQ on Llama and on Mixtral (its experts quantized, its routers left out as AutoAWQ leaves them);
# GPTQ v1 symmetric on Qwen2 (q/k/v biases beside quantized weights), v1 asymmetric with act-order on
# Qwen3 (tied embeddings), v2 8-bit in one group with act-order on Phi-3 (fused q/k/v and gate/up).
VARIANTS: dict[str, tuple[str, IntScheme]] = {
    "awq_llama": ("llama", AWQ_SCHEME),
    "awq_mixtral": ("mixtral", IntScheme("awq", ignore=("lm_head", "re:.*block_sparse_moe.gate"))),
    "gptq_qwen2": ("qwen2", IntScheme("gptq", sym=True)),
    "gptq_act_order_qwen3": ("qwen3", IntScheme("gptq", desc_act=True)),
    "gptq8_v2_phi3": ("phi3", IntScheme("gptq", bits=8, group_size=None, desc_act=True, checkpoint_format="gptq_v2")),
}


@pytest.fixture(scope="module")
def int_checkpoints(tiny_checkpoints, tmp_path_factory) -> dict[str, QuantizedCheckpoint]:
    return make_checkpoints(tiny_checkpoints, tmp_path_factory, VARIANTS, quantize_checkpoint)


# --- the formats, by hand -----------------------------------------------------------------------------

def test_awq_unpacks_each_int32_in_autoawqs_order():
    """One int32 holding codes 0..7 in its nibbles, lowest first: AutoAWQ puts output AWQ_ORDER[i] =
    (0, 2, 4, 6, 1, 3, 5, 7)[i] in nibble i, so outputs 0..7 read nibbles 0, 4, 1, 5, 2, 6, 3, 7."""
    q = IntQuantization(AWQ, 4, None)
    parts = {"qweight": torch.tensor([[0x76543210]], dtype=torch.int32),
             "qzeros": torch.tensor([[0x11111111]], dtype=torch.int32),  # every zero 1
             "scales": torch.full((1, 8), 0.5, dtype=torch.float16)}
    weight = dequantize(q, parts)  # [out 8, in 1]
    assert weight.flatten().tolist() == [(code - 1) * 0.5 for code in (0, 4, 1, 5, 2, 6, 3, 7)]


def test_gptq_unpacks_inputs_in_order_and_reads_v1_zeros_plus_one():
    """GPTQ packs inputs down a column in order (nibble i of row r is input 8r + i); v1 stores each zero
    minus one: 0x77777777 are zeros of 8, a symmetric 4-bit checkpoint's, and read as 7 in v2. The top
    nibble's sign bit (0xF...) is a code of 15, not a negative number."""
    qweight = torch.tensor([[0x76543210, -0x10000000 + 0xF] + [0] * 6], dtype=torch.int32)  # 8 inputs, 8 outputs
    parts = {"qweight": qweight, "qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
             "scales": torch.tensor([[1.0, 0.25] + [1.0] * 6], dtype=torch.float16)}
    v1 = dequantize(IntQuantization(GPTQ, 4, None, zero_offset=1), parts)  # [out 8, in 8]
    assert v1[0].tolist() == [float(code - 8) for code in range(8)]
    assert v1[1].tolist() == [(15 - 8) * 0.25] + [-2.0] * 6 + [(15 - 8) * 0.25]
    v2 = dequantize(IntQuantization(GPTQ, 4, None), parts)
    assert v2[0].tolist() == [float(code - 7) for code in range(8)]


def test_gptq_8_bit_packs_four_inputs_an_int32():
    """Byte i of row r is input 4r + i; a v1 zero byte of 0x7F is 128 (symmetric 8-bit); 0xFF is 255."""
    qweight = torch.tensor([[0x03020100, -1, 0, 0], [0x07060504, -1, 0, 0]], dtype=torch.int32)  # 8 in, 4 out
    parts = {"qweight": qweight, "qzeros": torch.tensor([[0x7F7F7F7F]], dtype=torch.int32),
             "scales": torch.tensor([[2.0, 0.5, 1.0, 1.0]], dtype=torch.float16)}
    weight = dequantize(IntQuantization(GPTQ, 8, None, zero_offset=1), parts)
    assert weight[0].tolist() == [(code - 128) * 2.0 for code in range(8)]
    assert weight[1].tolist() == [(255 - 128) * 0.5] * 8 and weight[2].tolist() == [-128.0] * 8


def test_act_order_takes_each_inputs_group_from_g_idx():
    """desc_act: GPTQ quantizes the inputs in a permuted order and groups them in that order, so input i's
    scale and zero are row g_idx[i]'s. The weights equal (q - z[g_idx]) * s[g_idx] exactly, and reading
    the groups as input // group_size instead gives other weights."""
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    scheme = IntScheme("gptq", group_size=16, desc_act=True)
    quantized = quantize(weight, scheme)
    assert not torch.equal(quantized.g_idx, torch.arange(64) // 16)  # a permuted grouping
    parts = stored_parts(quantized, scheme)
    q = IntQuantization(GPTQ, 4, 16, desc_act=True, zero_offset=1)
    assert torch.equal(dequantize(q, parts), quantized.dequantized())
    assert (dequantize(q, parts) - weight).abs().max() <= quantized.scales.float().max()  # a 4-bit grid near it
    sequential = {name: part for name, part in parts.items() if name != "g_idx"}
    assert not torch.equal(dequantize(q, sequential), quantized.dequantized())


@pytest.mark.parametrize("scheme", [AWQ_SCHEME, IntScheme("awq", group_size=None),
                                    IntScheme("gptq", bits=8, checkpoint_format="gptq_v2"), IntScheme("gptq", sym=True)])
def test_dequantized_weights_are_the_grid_values_exactly(scheme):
    """Wide enough that a weight is dequantized in several slabs of inputs."""
    torch.manual_seed(1)
    weight = torch.randn(4096, 2048)
    quantized = quantize(weight, scheme)
    method_q = read_config_quantization(scheme)
    assert torch.equal(dequantize(method_q, stored_parts(quantized, scheme)), quantized.dequantized())


def read_config_quantization(scheme: IntScheme) -> IntQuantization:
    config = LlamaFamilyConfig.from_hf(llama_config(quantization_config=scheme.quantization_config()))
    assert isinstance(config.quantization, IntQuantization)
    return config.quantization


# --- checkpoints --------------------------------------------------------------------------------------

def test_each_variant_stores_packed_weights_and_leaves_the_rest(int_checkpoints):
    tensors = load_file(int_checkpoints["awq_mixtral"].directory / "model.safetensors")
    expert = "model.layers.0.block_sparse_moe.experts.3.w2"
    assert f"{expert}.weight" not in tensors
    assert tensors[f"{expert}.qweight"].shape == (32, 8) and tensors[f"{expert}.qweight"].dtype == torch.int32
    assert tensors[f"{expert}.qzeros"].shape == (1, 8) and tensors[f"{expert}.scales"].shape == (1, 64)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32  # not converted
    gptq = load_file(int_checkpoints["gptq_act_order_qwen3"].directory / "model.safetensors")
    assert gptq["model.layers.1.mlp.down_proj.qweight"].shape == (16, 64)  # 128 inputs, 8 an int32
    assert gptq["model.layers.1.mlp.down_proj.g_idx"].shape == (128,)
    assert read_config(int_checkpoints["gptq_act_order_qwen3"].directory).quantization == IntQuantization(
        GPTQ, 4, 32, desc_act=True, zero_offset=1)
    assert read_config(int_checkpoints["gptq8_v2_phi3"].directory).quantization == IntQuantization(
        GPTQ, 8, None, desc_act=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_equal_the_dequantized_checkpoints_exactly(int_checkpoints, variant, dtype):
    """(q - z) * s in float32, rounded once to the compute dtype: bit for bit what the float32
    checkpoint of the same weights loads as."""
    assert_loads_as_the_dense_checkpoint(int_checkpoints[variant], dtype)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_on_the_dequantized_weights(int_checkpoints, variant):
    assert_logits_match_transformers(int_checkpoints[variant])


@pytest.mark.parametrize("variant", ["awq_mixtral", "gptq_act_order_qwen3"])
def test_greedy_paged_decode_equals_transformers_generate_on_the_dequantized_weights(int_checkpoints, variant):
    ckpt = int_checkpoints[variant]
    assert_greedy_matches_transformers(ckpt, seed=300)


def test_the_memory_estimate_counts_the_dequantized_weights_not_the_file(int_checkpoints):
    assert_memory_estimate_counts_the_dequantized_weights(int_checkpoints["awq_llama"])


def test_parts_in_several_shards_are_gathered(int_checkpoints, tmp_path):
    """Shards split where they split: a weight's qweight, qzeros and scales may be in different files."""
    ckpt = int_checkpoints["gptq_qwen2"]
    directory = _copy(int_checkpoints, "gptq_qwen2", tmp_path)
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    files = {name: f"{'abc'[i % 3]}.safetensors" for i, name in enumerate(sorted(tensors))}
    for file in set(files.values()):
        save_file({n: t for n, t in tensors.items() if files[n] == file}, directory / file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": files}))
    got, expected = load_llama_family(directory).state_dict(), load_llama_family(ckpt.dense).state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got.items())


# --- refused ------------------------------------------------------------------------------------------

AWQ_CONFIG = AWQ_SCHEME.quantization_config()
GPTQ_CONFIG = IntScheme("gptq").quantization_config()


@pytest.mark.parametrize(("quantization", "field", "says"), [
    ({**AWQ_CONFIG, "bits": 8}, "bits", "8 is not supported; supported: 4"),
    ({**AWQ_CONFIG, "version": "gemv"}, "version", "'gemv' is not supported; supported: gemm"),
    ({**AWQ_CONFIG, "version": "exllama"}, "version", "supported: gemm"),
    ({**AWQ_CONFIG, "version": "marlin"}, "version", "supported: gemm"),
    ({**AWQ_CONFIG, "zero_point": False}, "zero_point", "supported: true"),
    ({**AWQ_CONFIG, "backend": "llm-awq"}, "backend", "supported: autoawq"),
    ({**AWQ_CONFIG, "group_size": 0}, "group_size", "a positive int, or -1"),
    ({k: v for k, v in AWQ_CONFIG.items() if k != "group_size"}, "group_size", "got None"),
    ({**AWQ_CONFIG, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert", "a list of module names"),
    ({**GPTQ_CONFIG, "bits": 3}, "bits", "3 is not supported; supported: 4, 8"),
    ({**GPTQ_CONFIG, "bits": 2}, "bits", "supported: 4, 8"),
    ({**GPTQ_CONFIG, "bits": True}, "bits", "supported: 4, 8"),
    # JSON's 8.0 equals 8 but is no int: it was let through to an assert (an AssertionError, not a refusal).
    ({**GPTQ_CONFIG, "bits": 8.0}, "bits", "8.0 is not supported; supported: 4, 8"),
    ({k: v for k, v in AWQ_CONFIG.items() if k != "bits"} | {"w_bit": 4.0}, "w_bit", "4.0 is not supported"),
    ({**GPTQ_CONFIG, "group_size": "128"}, "group_size", "a positive int"),
    ({**GPTQ_CONFIG, "desc_act": "yes"}, "desc_act", "must be true or false"),
    ({**GPTQ_CONFIG, "checkpoint_format": "marlin"}, "checkpoint_format", "supported: gptq, gptq_v2"),
    ({**GPTQ_CONFIG, "is_marlin_format": True}, "is_marlin_format", "supported: false"),
    ({**GPTQ_CONFIG, "pack_dtype": "int16"}, "pack_dtype", "supported: int32"),
    ({**GPTQ_CONFIG, "dynamic": {"-:.*down_proj": {}}}, "dynamic", "per-module overrides are not supported"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method",
     "'bitsandbytes' is not supported; supported: fp8, compressed-tensors, awq, gptq"),
])
def test_unsupported_quantization_names_the_field(quantization, field, says):
    with pytest.raises(CheckpointError) as caught:
        LlamaFamilyConfig.from_hf(llama_config(quantization_config=quantization), file="dir/config.json")
    assert caught.value.field == f"quantization_config.{field}" and says in str(caught.value)


def test_the_configs_read_as_the_quantizers_write_them():
    """AutoAWQ's config.json (with transformers' fields) and its own spellings w_bit / q_group_size;
    an AutoGPTQ v1 config with act-order; GPTQModel's v2 with group_size -1."""
    autoawq = {"quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "GEMM",
               "modules_to_not_convert": None, "do_fuse": False}
    assert LlamaFamilyConfig.from_hf(llama_config(quantization_config=autoawq)).quantization == IntQuantization(
        AWQ, 4, 128)
    spelled = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "gemm"}
    assert LlamaFamilyConfig.from_hf(llama_config(quantization_config=spelled)).quantization == IntQuantization(
        AWQ, 4, 64)
    autogptq = {"bits": 4, "group_size": 128, "damp_percent": 0.01, "desc_act": True, "static_groups": False,
                "sym": True, "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
                "quant_method": "gptq"}
    assert LlamaFamilyConfig.from_hf(llama_config(quantization_config=autogptq)).quantization == IntQuantization(
        GPTQ, 4, 128, desc_act=True, zero_offset=1)
    gptqmodel = {"bits": 8, "group_size": -1, "desc_act": False, "sym": True, "lm_head": False,
                 "quant_method": "gptq", "checkpoint_format": "gptq_v2", "pack_dtype": "int32", "dynamic": None,
                 "meta": {"quantizer": ["gptqmodel:2.0.0"]}}
    assert LlamaFamilyConfig.from_hf(llama_config(quantization_config=gptqmodel)).quantization == IntQuantization(
        GPTQ, 8, None)


def _copy(int_checkpoints, variant: str, tmp_path: Path) -> Path:
    directory = tmp_path / variant
    shutil.copytree(int_checkpoints[variant].directory, directory)
    return directory


Q_PROJ = "model.layers.0.self_attn.q_proj"  # [64, 64]: AWQ's qweight [64, 8], qzeros [2, 8], scales [2, 64]
DOWN = "model.layers.1.mlp.down_proj"  # [64, 128]: GPTQ's qweight [16, 64], qzeros [4, 8], scales [4, 64]


def _shuffle_g_idx(t: dict[str, torch.Tensor]) -> None:
    t[f"{DOWN}.g_idx"] = t[f"{DOWN}.g_idx"].flip(0).contiguous()


@pytest.mark.parametrize(("variant", "edit", "tensor", "says"), [
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"][:, :4].contiguous()}),
     f"{Q_PROJ}.qweight", "shape [64, 4], but awq 4-bit with group_size 32 stores a [64, 64] weight's qweight as [64, 8]"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"].T.contiguous()}),
     f"{Q_PROJ}.qweight", "shape [8, 64]"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.qweight": t[f"{Q_PROJ}.qweight"].float()}),
     f"{Q_PROJ}.qweight", "dtype F32 is not supported for qweight; supported: I32"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.qzeros": t[f"{Q_PROJ}.qzeros"].to(torch.int64)}),
     f"{Q_PROJ}.qzeros", "dtype I64 is not supported for qzeros; supported: I32"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.scales": t[f"{Q_PROJ}.scales"].double()}),
     f"{Q_PROJ}.scales", "dtype F64 is not supported for scales; supported: F16, BF16, F32"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.scales": t[f"{Q_PROJ}.scales"][:1].contiguous()}),
     f"{Q_PROJ}.scales", "shape [1, 64], but awq 4-bit with group_size 32 stores a [64, 64] weight's scales as [2, 64]"),
    ("awq_llama", lambda t: t.pop(f"{Q_PROJ}.qzeros"), f"{Q_PROJ}.qzeros", f"missing beside {Q_PROJ}.qweight"),
    ("awq_llama", lambda t: t.pop(f"{Q_PROJ}.scales"), f"{Q_PROJ}.scales", "missing beside"),
    ("awq_llama", lambda t: t.pop(f"{Q_PROJ}.qweight"), f"{Q_PROJ}.qweight", f"missing beside {Q_PROJ}.qzeros"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.weight": torch.zeros(64, 64)}), f"{Q_PROJ}.qweight",
     "a Linear weight is stored quantized or as it is, not both"),
    ("awq_llama", lambda t: t.update({f"{Q_PROJ}.g_idx": torch.zeros(64, dtype=torch.int32)}), f"{Q_PROJ}.g_idx",
     "unexpected tensor"),  # AWQ stores no groups
    ("awq_llama", lambda t: t.update({"model.embed_tokens.qweight": torch.zeros(512, 8, dtype=torch.int32)}),
     "model.embed_tokens.qweight", "not a Linear weight of this model"),
    ("awq_llama", lambda t: t.update({"model.norm.scales": torch.zeros(2, 64, dtype=torch.float16)}),
     "model.norm.scales", "not a Linear weight of this model"),
    ("gptq_act_order_qwen3", lambda t: t.pop(f"{DOWN}.g_idx"), f"{DOWN}.g_idx",
     "quantization_config.desc_act is true: each input's group is stored"),
    ("gptq_act_order_qwen3", lambda t: t.update({f"{DOWN}.g_idx": t[f"{DOWN}.g_idx"][:64].contiguous()}),
     f"{DOWN}.g_idx", "shape [64], but gptq 4-bit with group_size 32 stores a [64, 128] weight's g_idx as [128]"),
    ("gptq_act_order_qwen3", lambda t: t.update({f"{DOWN}.qweight": t[f"{DOWN}.qweight"][:8].contiguous()}),
     f"{DOWN}.qweight", "shape [8, 64]"),
    ("gptq_act_order_qwen3", lambda t: t.update({f"{DOWN}.g_idx": t[f"{DOWN}.g_idx"] + 3}), f"{DOWN}.g_idx",
     "not one of the 4 groups its scales hold"),
])
def test_a_broken_quantized_weight_names_the_tensor(int_checkpoints, tmp_path, variant, edit, tensor, says):
    directory = _copy(int_checkpoints, variant, tmp_path)
    edit_tensors(directory / "model.safetensors", edit)
    error = refusal(directory)
    assert (error.field, error.file) == (tensor, str(directory / "model.safetensors")), str(error)
    assert says in str(error)


@pytest.mark.parametrize(("variant", "quantization", "tensor", "says"), [
    # 128 inputs of down_proj in groups of 48: the shapes cannot be right, and the reason is the config's.
    ("gptq_qwen2", {"group_size": 48}, "model.layers.0.mlp.down_proj.qweight",
     "not a multiple of quantization_config.group_size 48"),
    ("awq_llama", {"group_size": 48}, "model.layers.0.mlp.down_proj.qweight",
     "its 128 inputs are not a multiple of quantization_config.group_size 48"),
    ("gptq_qwen2", {"bits": 8}, "model.layers.0.mlp.down_proj.qweight", "shape [16, 64], but gptq 8-bit"),
    ("gptq_qwen2", {"desc_act": True, "group_size": 64}, "model.layers.0.mlp.down_proj.qzeros", "shape [4, 8]"),
])
def test_a_config_that_does_not_fit_the_tensors_names_the_tensor_and_the_field(int_checkpoints, tmp_path, variant,
                                                                              quantization, tensor, says):
    directory = _copy(int_checkpoints, variant, tmp_path)
    edit_config(directory, lambda c: c["quantization_config"].update(quantization))
    error = refusal(directory)
    assert error.file == str(directory / "model.safetensors") and says in str(error), str(error)
    assert error.field.endswith(tensor.rpartition(".")[2]), str(error)


def test_packed_weights_without_a_quantization_config_are_refused_as_unexpected(int_checkpoints, tmp_path):
    directory = _copy(int_checkpoints, "awq_llama", tmp_path)
    edit_config(directory, lambda c: c.pop("quantization_config"))
    error = refusal(directory)
    assert "unexpected tensor" in str(error) and error.field.rpartition(".")[2] in ("qweight", "qzeros", "scales")


def test_an_unquantized_module_beside_quantized_ones_is_read_as_stored(int_checkpoints, tmp_path):
    """Whatever the quantizer left out (modules_to_not_convert, GPTQ's lm_head: false) is a plain weight."""
    ckpt = int_checkpoints["awq_llama"]
    directory = _copy(int_checkpoints, "awq_llama", tmp_path)
    dense = load_file(ckpt.dense / "model.safetensors")

    def unquantize(t: dict[str, Any]) -> None:
        for part in ("qweight", "qzeros", "scales"):
            del t[f"{Q_PROJ}.{part}"]
        t[f"{Q_PROJ}.weight"] = dense[f"{Q_PROJ}.weight"]
    edit_tensors(directory / "model.safetensors", unquantize)
    got, expected = load_llama_family(directory).state_dict(), load_llama_family(ckpt.dense).state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got.items())


O_PROJ = "model.layers.1.self_attn.o_proj"


def test_a_zero_bias_beside_a_quantized_weight_is_read_past_and_a_non_zero_one_refused(int_checkpoints, tmp_path):
    """Older AutoGPTQ stored a bias on every quantized Linear, zeros where the model has none (vLLM reads
    them past): the model loads as without them; a bias that is not zero would change the model, and one
    beside a plain weight is simply unexpected."""
    ckpt = int_checkpoints["gptq_qwen2"]
    directory = _copy(int_checkpoints, "gptq_qwen2", tmp_path)
    path = directory / "model.safetensors"
    edit_tensors(path, lambda t: t.update({f"{O_PROJ}.bias": torch.zeros(64, dtype=torch.float16),
                                           "model.layers.0.mlp.up_proj.bias": torch.zeros(128)}))
    got, expected = load_llama_family(directory).state_dict(), load_llama_family(ckpt.dense).state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in got.items())

    edit_tensors(path, lambda t: t.update({f"{O_PROJ}.bias": torch.full((64,), 0.5)}))
    error = refusal(directory)
    assert error.field == f"{O_PROJ}.bias" and "a non-zero bias" in str(error)
    edit_tensors(path, lambda t: t.update({f"{O_PROJ}.bias": torch.zeros(32)}))
    assert "shape [32], but gptq 4-bit with group_size 32 stores a [64, 64] weight's bias as [64]" in str(refusal(directory))
    edit_tensors(path, lambda t: t.update({f"{O_PROJ}.bias": torch.zeros(64), "lm_head.bias": torch.zeros(512)}))
    error = refusal(directory)
    assert error.field == "lm_head.bias" and "unexpected tensor" in str(error)


@pytest.mark.parametrize(("quantization", "said"), [
    (IntQuantization(AWQ, 4, 128), "awq 4-bit, group_size 128 (GEMM layout)"),
    (IntQuantization(GPTQ, 8, None, desc_act=True), "gptq 8-bit, one group, act-order (v2 zeros)"),
    (IntQuantization(GPTQ, 4, 64, zero_offset=1), "gptq 4-bit, group_size 64 (v1 zeros)"),
    (Fp8Quantization("fp8", "weight_scale_inv", "block", (128, 128)), "fp8 FP8 (e4m3), a scale per 128 x 128 blocks"),
    (Fp8Quantization("compressed-tensors", "weight_scale", "channel"), "compressed-tensors FP8 (e4m3), a scale per channel"),
])
def test_the_import_describes_the_scheme_in_a_few_words(quantization, said):
    assert describe(quantization) == said
