"""`infermesh models import` of a Hugging Face checkpoint: the version it writes (files unchanged and
pinned, the manifest's tokenizer, stop ids, envelope and golden cases), how a worker loads it, and
what it refuses, naming the file and the field, with nothing written."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from infermesh.v1 import scheduler_pb2
from services.common.protocol import TOKENIZER_FILE_CHUNK_BYTES
from services.worker.attach_client import _tokenizer_file_pieces
from services.worker.model_runtime import GeneratorRuntime
from services.worker.models.llama_weights import read_config
from services.worker.repository.errors import ChecksumMismatch, IncompatibleWeights, InvalidManifest
from services.worker.repository.hf_import import (
    ImportOptions,
    ImportRefused,
    import_checkpoint,
    kv_bytes_per_token,
    weight_bytes,
)
from services.worker.repository.loader import load_model
from services.worker.repository.store import load_manifest, sha256_of, version_dir, write_manifest
from tests.support import awq_gptq_checkpoints, reasoning_templates
from tests.support.fp8_checkpoints import Fp8Scheme, quantize_checkpoint, save_dequantized
from tests.support.hf_checkpoints import CHAT_TEMPLATE, END_OF_TEXT_ID, EOT_ID, save_model_directory

OPTIONS = ImportOptions("tiny", "1", kv_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, object]:
    directory = tmp_path_factory.mktemp("hf-qwen2")
    return directory, save_model_directory(directory, "qwen2")


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    import_checkpoint(checkpoint[0], root, OPTIONS)
    return root


def copy_of(checkpoint, tmp_path: Path) -> Path:
    shutil.copytree(checkpoint[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_import_pins_the_directorys_files_unchanged_beside_the_manifest(checkpoint, imported):
    source = checkpoint[0]
    target = version_dir(imported, "tiny", "1")
    manifest = load_manifest(imported, "tiny", "1")
    spec = manifest.generator
    pinned = [*manifest.weights.pinned, spec.architecture.config, *spec.tokenizer.pinned]
    assert {p.file for p in pinned} == {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                                        "chat_template.jinja"}
    for p in pinned:
        assert (target / p.file).read_bytes() == (source / p.file).read_bytes()
        assert p.sha256 == sha256_of(source / p.file)
    assert spec.architecture.architecture == "Qwen2ForCausalLM"
    assert (spec.tokenizer.eos_token_id, spec.tokenizer.stop_token_ids) == (END_OF_TEXT_ID, (EOT_ID,))


def test_the_envelope_fills_the_kv_budget_and_max_seq_len_defaults_to_the_context(checkpoint, imported):
    manifest = load_manifest(imported, "tiny", "1")
    config = read_config(checkpoint[0])
    per_block = kv_bytes_per_token(config) * manifest.envelope.block_size
    assert manifest.envelope.num_kv_blocks == (1 << 20) // per_block
    assert manifest.generator.max_seq_len == config.max_position_embeddings


def test_golden_cases_are_transformers_greedy_continuations(checkpoint, imported):
    assert_transformers_greedy(load_manifest(imported, "tiny", "1").generator.golden, checkpoint[1])


def test_a_worker_loads_the_version_says_hf_and_sends_tokenizer_json_after_its_hello(imported):
    model = load_model(imported, "tiny", "1")
    runtime = GeneratorRuntime(model, model.manifest.envelope.num_kv_blocks)
    runtime.load()  # warm-up and the golden check
    hello = runtime.hello("w1")
    target = version_dir(imported, "tiny", "1")
    assert hello.tokenizer.kind == scheduler_pb2.TOKENIZER_KIND_HF
    assert (hello.tokenizer.eos_token_id, list(hello.tokenizer.stop_token_ids)) == (END_OF_TEXT_ID, [EOT_ID])
    assert hello.tokenizer.tokenizer_json_sha256 == sha256_of(target / "tokenizer.json")
    assert hello.tokenizer.chat_template == CHAT_TEMPLATE
    assert hello.tokenizer.special_tokens["bos_token"] == "<|begin_of_text|>"
    pieces = _tokenizer_file_pieces(runtime)
    assert b"".join(pieces) == (target / "tokenizer.json").read_bytes()
    assert all(1 <= len(p) <= TOKENIZER_FILE_CHUNK_BYTES for p in pieces)


def test_compute_dtype_bfloat16_loads_the_weights_in_bfloat16(imported):
    model = load_model(imported, "tiny", "1", compute_dtype="bfloat16")
    assert model.generator.lm.embed_weight.dtype == torch.bfloat16


def test_a_modified_file_is_refused_before_it_is_read(imported, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(imported, root)
    path = version_dir(root, "tiny", "1") / "tokenizer.json"
    path.write_bytes(path.read_bytes().replace(b"<|eot_id|>", b"<|eot_xx|>"))
    model = load_model(root, "tiny", "1")
    with pytest.raises(ChecksumMismatch, match="tokenizer file .*tokenizer.json"):
        GeneratorRuntime(model, 8)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_loaded_parameters_are_the_files_tensors_in_the_compute_dtype(imported, compute_dtype):
    """Read once into the fused parameters (straight in when the dtypes agree, through a cast otherwise)."""
    lm = load_model(imported, "tiny", "1", compute_dtype=compute_dtype).generator.lm
    stored = load_file(version_dir(imported, "tiny", "1") / "model.safetensors")
    dtype = getattr(torch, compute_dtype)
    c, layer = lm.config, lm.layers[1]
    q, kv = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    expected = {
        "model.embed_tokens.weight": lm.embed_weight,
        "model.layers.1.self_attn.q_proj.weight": layer.qkv_weight[:q],
        "model.layers.1.self_attn.v_proj.weight": layer.qkv_weight[q + kv:],
        "model.layers.1.self_attn.k_proj.bias": layer.qkv_bias[q:q + kv],
        "model.layers.1.mlp.up_proj.weight": layer.gate_up_weight[c.d_ff:],
        "model.layers.1.mlp.down_proj.weight": layer.down_weight,
        "model.norm.weight": lm.final_norm,
    }
    for name, param in expected.items():
        assert torch.equal(param, stored[name].to(dtype)), name


@pytest.mark.parametrize("change", ["a tensor's byte", "the header", "a truncated file"])
def test_modified_weights_are_refused_as_modified_whatever_broke_in_them(imported, tmp_path, change):
    """The weights are hashed as they are read: a change anywhere is a ChecksumMismatch naming the file,
    also where the change breaks the file before the hash is complete."""
    root = tmp_path / "repo"
    shutil.copytree(imported, root)
    path = version_dir(root, "tiny", "1") / "model.safetensors"
    data = bytearray(path.read_bytes())
    if change == "a tensor's byte":
        data[-3] ^= 0x40
    elif change == "the header":
        data[9:13] = b"XXXX"
    else:
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="weights file .*model.safetensors has sha256"):
        load_model(root, "tiny", "1")


def test_an_unsupported_architecture_is_refused_at_load_naming_the_field_and_what_is_supported(imported, tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(imported, root)
    directory = version_dir(root, "tiny", "1")
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (directory / "config.json").write_text(json.dumps(config))
    manifest = load_manifest(root, "tiny", "1")
    spec = manifest.generator
    config_pin = dataclasses.replace(spec.architecture.config, sha256=sha256_of(directory / "config.json"))
    write_manifest(dataclasses.replace(manifest, generator=dataclasses.replace(
        spec, architecture=dataclasses.replace(spec.architecture, config=config_pin))), directory)
    with pytest.raises(IncompatibleWeights, match=r"architectures\[0\].*GPT2LMHeadModel.*supported: Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, GraniteForCausalLM"):
        load_model(root, "tiny", "1")


def edited_manifest(imported: Path, tmp_path: Path, edit) -> Path:
    """A copy of the imported repository whose manifest `edit(generator_block)` changed; its root."""
    root = tmp_path / "repo"
    shutil.copytree(imported, root)
    path = version_dir(root, "tiny", "1") / "manifest.json"
    data = json.loads(path.read_text())
    edit(data["generator"])
    path.write_text(json.dumps(data))
    return root


def test_a_manifest_naming_an_unsupported_architecture_is_invalid(imported, tmp_path):
    root = edited_manifest(imported, tmp_path, lambda g: g["architecture"].update(architecture="GPT2LMHeadModel"))
    with pytest.raises(InvalidManifest, match=r"generator.architecture.architecture.*supported: Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, GraniteForCausalLM"):
        load_manifest(root, "tiny", "1")


@pytest.mark.parametrize("parser", ["llama3_json", "xml"])
def test_a_manifests_tool_call_parser_reaches_the_hello_and_an_unknown_one_is_invalid(imported, tmp_path, parser):
    root = tmp_path / "repo"
    shutil.copytree(imported, root)
    path = version_dir(root, "tiny", "1") / "manifest.json"
    data = json.loads(path.read_text())
    data["generator"]["tokenizer"]["tool_call_parser"] = parser
    path.write_text(json.dumps(data))
    if parser == "xml":
        with pytest.raises(InvalidManifest, match=r"generator.tokenizer.tool_call_parser.*hermes.*got 'xml'"):
            load_manifest(root, "tiny", "1")
        return
    assert load_manifest(root, "tiny", "1").generator.tokenizer.to_json()["tool_call_parser"] == parser
    runtime = GeneratorRuntime(model := load_model(root, "tiny", "1"), model.manifest.envelope.num_kv_blocks)
    assert runtime.hello("w1").tokenizer.tool_call_parser == parser


def test_the_importer_records_a_tool_call_parser_given(checkpoint, tmp_path):
    import_checkpoint(checkpoint[0], tmp_path, dataclasses.replace(OPTIONS, tool_call_parser="hermes"))
    assert load_manifest(tmp_path, "tiny", "1").generator.tokenizer.to_json()["tool_call_parser"] == "hermes"


def refused(source: Path, tmp_path: Path, **options) -> str:
    root = tmp_path / "repo"
    with pytest.raises(ImportRefused) as caught:
        import_checkpoint(source, root, dataclasses.replace(OPTIONS, **options))
    assert not version_dir(root, "tiny", "1").exists()
    assert not any(root.glob("tiny/.*"))  # no staging left behind
    return str(caught.value)


def test_a_corrupt_safetensors_header_is_refused_naming_the_file(checkpoint, tmp_path):
    source = copy_of(checkpoint, tmp_path)
    data = bytearray((source / "model.safetensors").read_bytes())
    data[8:40] = b"{ not json at all, truncated ...."[:32]
    (source / "model.safetensors").write_bytes(bytes(data))
    assert "model.safetensors: header: not a readable safetensors file" in refused(source, tmp_path)


@pytest.mark.parametrize(("change", "says"), [
    (lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(64, 128)),
     "model.layers.1.mlp.up_proj.weight: shape [64, 128] but config.json implies [128, 64]"),
    (lambda t: t.__setitem__("model.norm.weight", torch.zeros(64, dtype=torch.int32)),
     "model.norm.weight: dtype I32 is not supported; supported: F32, F16, BF16"),
])
def test_a_tensor_of_the_wrong_shape_or_dtype_is_refused_naming_it(checkpoint, tmp_path, change, says):
    source = copy_of(checkpoint, tmp_path)
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    assert says in refused(source, tmp_path)


def test_a_missing_tokenizer_is_refused(checkpoint, tmp_path):
    source = copy_of(checkpoint, tmp_path)
    (source / "tokenizer.json").unlink()
    assert "tokenizer.json: missing" in refused(source, tmp_path)


def test_a_tokenizer_larger_than_vocab_size_is_refused(tmp_path):
    source = tmp_path / "small-vocab"
    save_model_directory(source, "llama", vocab_size=300)
    assert "ids up to 420, but config.json's vocab_size is 300" in refused(source, tmp_path)


def test_an_unsupported_architecture_is_refused_at_import(checkpoint, tmp_path):
    source = copy_of(checkpoint, tmp_path)
    config = json.loads((source / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e6, "factor": 4.0}
    (source / "config.json").write_text(json.dumps(config))
    says = refused(source, tmp_path)
    assert ("config.json: rope_parameters.rope_type: 'longrope' is not supported; "
            "supported: default, linear, llama3, yarn") in says


def test_a_kv_budget_below_one_sequence_is_refused_naming_the_flags(checkpoint, tmp_path):
    says = refused(checkpoint[0], tmp_path, kv_cache_bytes=1 << 14, max_seq_len=256)
    assert "--kv-cache-gb" in says and "--max-seq-len" in says


def test_an_existing_version_is_never_overwritten(checkpoint, imported):
    with pytest.raises(ImportRefused, match="already exists"):
        import_checkpoint(checkpoint[0], imported, OPTIONS)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "granite", "smollm3", "olmo2", "gemma3_vision", "qwen3_moe"])
def test_the_newer_families_import_golden_check_and_load_in_a_worker(family, tmp_path):
    """Qwen3 (q/k norms), Phi-3 (fused projections), Granite (scalings), SmolLM3 (NoPE layers), OLMo 2 (norms
    after each branch), Gemma 3 with its vision tower (text-only) and Qwen3-MoE (routed experts beside a dense
    layer; Mixtral's and Qwen2-MoE's import differs from it only in what models/ checks): the import records
    golden cases from its own float32 forward, checks them as a worker loads, and they are transformers' greedy
    continuations."""
    source, root = tmp_path / family, tmp_path / "repo"
    reference = save_model_directory(source, family)
    manifest = import_checkpoint(source, root, OPTIONS)
    assert manifest.generator.architecture.architecture == type(reference).__name__
    assert_transformers_greedy(manifest.generator.golden, reference)
    model = load_model(root, "tiny", "1")
    GeneratorRuntime(model, model.manifest.envelope.num_kv_blocks).load()  # warm-up and the golden check


def test_a_vision_checkpoint_imports_its_language_model_and_pins_the_image_side_too(tmp_path):
    """The memory estimate is what the worker holds (no vision tower); the vision tower's bytes are
    still the weights file's: one changed is refused as a modified file."""
    source, root = tmp_path / "gemma3_vision", tmp_path / "repo"
    reference = save_model_directory(source, "gemma3_vision")
    manifest = import_checkpoint(source, root, OPTIONS)
    config = read_config(source)
    language_model = 4 * sum(p.numel() for p in reference.model.language_model.parameters())
    assert weight_bytes(config) == language_model < 4 * sum(p.numel() for p in reference.parameters())
    per_block = kv_bytes_per_token(config) * manifest.envelope.block_size
    assert manifest.envelope.memory_bytes == language_model + manifest.envelope.num_kv_blocks * per_block

    path = version_dir(root, "tiny", "1") / "model.safetensors"
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8:8 + header_size])["vision_tower.post_layernorm.weight"]["data_offsets"]
    data[8 + header_size + begin] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="weights file .*model.safetensors has sha256"):
        load_model(root, "tiny", "1")

    # Without generation_config.json, the end ids come from config.json, where transformers 5 may write
    # them only in text_config.
    (source / "generation_config.json").unlink()
    raw = json.loads((source / "config.json").read_text())
    raw["text_config"].update(eos_token_id=[END_OF_TEXT_ID, EOT_ID], bos_token_id=0)
    raw.pop("eos_token_id", None)
    raw.pop("bos_token_id", None)
    (source / "config.json").write_text(json.dumps(raw))
    tokenizer = import_checkpoint(source, root, dataclasses.replace(OPTIONS, version="2")).generator.tokenizer
    assert (tokenizer.eos_token_id, tokenizer.stop_token_ids) == (END_OF_TEXT_ID, (EOT_ID,))



def test_an_fp8_checkpoint_imports_its_dequantized_model_and_a_worker_loads_it(tmp_path):
    """Qwen3 as Qwen3-*-FP8 are published (float8 weights, a float32 scale per block): the memory estimate
    counts the float32 weights the worker holds after dequantizing, not the file's bytes; the golden cases
    are transformers' greedy continuations on the dequantized weights, and a worker passes them."""
    source, root = tmp_path / "qwen3_fp8", tmp_path / "repo"
    save_model_directory(source, "qwen3")
    save_dequantized(source, tmp_path / "dense", quantize_checkpoint(source, Fp8Scheme("fp8")))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    manifest = import_checkpoint(source, root, OPTIONS)
    config = read_config(source)
    held = 4 * sum(p.numel() for p in reference.parameters())
    assert config.quantization is not None and weight_bytes(config) == held > (source / "model.safetensors").stat().st_size
    per_block = kv_bytes_per_token(config) * manifest.envelope.block_size
    assert manifest.envelope.memory_bytes == held + manifest.envelope.num_kv_blocks * per_block
    assert manifest.generator.golden
    assert_transformers_greedy(manifest.generator.golden, reference)
    model = load_model(root, "tiny", "1")
    GeneratorRuntime(model, model.manifest.envelope.num_kv_blocks).load()  # warm-up and the golden check


@pytest.mark.parametrize("scheme", [awq_gptq_checkpoints.IntScheme("awq"),
                                    awq_gptq_checkpoints.IntScheme("gptq", desc_act=True)],
                         ids=["awq", "gptq_act_order"])
def test_an_awq_or_gptq_checkpoint_imports_its_dequantized_model_and_a_worker_serves_it(tmp_path, scheme):
    """A float16 checkpoint as AutoAWQ and AutoGPTQ publish them (packed int32 weights, float16 scales
    and everything else): the manifest pins config.json, which says the scheme; the memory estimate
    counts the float32 weights the worker holds; the golden cases are transformers' greedy
    continuations on the dequantized weights, and a worker passes them."""
    source, root = tmp_path / "quantized", tmp_path / "repo"
    save_model_directory(source, "llama", dtype=torch.float16)
    save_dequantized(source, tmp_path / "dense", awq_gptq_checkpoints.quantize_checkpoint(source, scheme))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    manifest = import_checkpoint(source, root, OPTIONS)
    pinned = json.loads((version_dir(root, "tiny", "1") / "config.json").read_text())
    assert pinned["quantization_config"]["quant_method"] == scheme.method
    assert manifest.generator.architecture.config.sha256 == sha256_of(source / "config.json")
    held = 4 * sum(p.numel() for p in reference.parameters())
    assert weight_bytes(read_config(source)) == held > (source / "model.safetensors").stat().st_size
    assert manifest.generator.golden
    assert_transformers_greedy(manifest.generator.golden, reference)
    model = load_model(root, "tiny", "1")
    GeneratorRuntime(model, model.manifest.envelope.num_kv_blocks).load()  # warm-up and the golden check


@pytest.mark.parametrize(("template", "flag", "recorded"), [
    (None, None, None),  # CHAT_TEMPLATE writes no think blocks
    (reasoning_templates.QWEN3, None, "qwen3"),  # told from the template
    (reasoning_templates.QWEN3, "deepseek_r1", "deepseek_r1"),  # the flag overrides it
    (reasoning_templates.QWEN3, "", None),  # --reasoning-parser none: nothing recorded
    (None, "qwen3", "qwen3"),
])
def test_the_importer_tells_the_reasoning_parser_from_the_template_unless_given(tmp_path, template, flag, recorded):
    source = tmp_path / "ckpt"
    save_model_directory(source, "qwen2", chat_template=template)
    import_checkpoint(source, tmp_path / "repo", dataclasses.replace(OPTIONS, reasoning_parser=flag))
    tokenizer = load_manifest(tmp_path / "repo", "tiny", "1").generator.tokenizer
    assert tokenizer.to_json().get("reasoning_parser") == recorded
    model = load_model(tmp_path / "repo", "tiny", "1")
    runtime = GeneratorRuntime(model, model.manifest.envelope.num_kv_blocks)
    assert runtime.hello("w1").tokenizer.reasoning_parser == (recorded or "")


def test_the_importer_refuses_an_unknown_reasoning_parser_naming_the_flag(checkpoint, tmp_path):
    says = refused(checkpoint[0], tmp_path, reasoning_parser="granite")
    assert says == "--reasoning-parser must be one of qwen3, deepseek_r1 or none, got 'granite'"


def test_a_manifests_unknown_reasoning_parser_is_invalid_naming_the_field(imported, tmp_path):
    root = edited_manifest(imported, tmp_path, lambda g: g["tokenizer"].update(reasoning_parser="granite"))
    with pytest.raises(InvalidManifest, match=r"generator.tokenizer.reasoning_parser.*'qwen3' or 'deepseek_r1'.*"
                                              r"got 'granite'"):
        load_manifest(root, "tiny", "1")


def test_the_import_records_generation_configs_recommended_sampling_unless_told_not_to(tmp_path):
    source = tmp_path / "ckpt"
    save_model_directory(source, "qwen2")
    path = source / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    import_checkpoint(source, tmp_path / "repo", OPTIONS)
    spec = load_manifest(tmp_path / "repo", "tiny", "1").generator
    assert spec.sampling_defaults.to_json() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    model = load_model(tmp_path / "repo", "tiny", "1")
    hello = GeneratorRuntime(model, model.manifest.envelope.num_kv_blocks).hello("w1")
    assert (hello.sampling_defaults.top_k, hello.sampling_defaults.HasField("min_p")) == (20, False)

    import_checkpoint(source, tmp_path / "repo", dataclasses.replace(OPTIONS, version="2", generation_config=False))
    assert load_manifest(tmp_path / "repo", "tiny", "2").generator.sampling_defaults.empty

    path.write_text(json.dumps({**json.loads(path.read_text()), "top_p": 1.5}))
    says = refused(source, tmp_path / "another")
    assert "generation_config.json: top_p must be in (0, 1], got 1.5" in says and "--generation-config none" in says


def assert_transformers_greedy(golden, reference) -> None:
    """Each golden case is transformers' greedy continuation of its prompt."""
    for case in golden:
        with torch.no_grad():
            out = reference.generate(torch.tensor([case.prompt_ids]), do_sample=False,
                                     max_new_tokens=len(case.expected_ids), eos_token_id=None, pad_token_id=1)
        assert tuple(out[0, len(case.prompt_ids):].tolist()) == case.expected_ids
