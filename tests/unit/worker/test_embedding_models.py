"""Embedding models at the worker: `infermesh models import` of a sentence-transformers directory records
the pooling, normalization and golden vectors (and refuses what it cannot serve, naming the file and
field); pooling across chunks equals pooling the whole prompt; the step executor pools chunked prompts
batched in one step, returns each vector on the step that ends its prompt, and fails a sequence whose
chunks skip a position; the hello declares the model's embeddings."""

from __future__ import annotations

import json
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from infermesh.v1 import common_pb2
from services.worker.model_runtime import GeneratorRuntime
from services.worker.models.llama_weights import read_config
from services.worker.pooling import PooledSequence, Pooling, PoolingSpec, pool_dense
from services.worker.repository.errors import InvalidManifest
from services.worker.repository.golden import run_golden_check
from services.worker.repository.hf_import import (
    ImportOptions,
    ImportRefused,
    import_checkpoint,
    kv_bytes_per_token,
    weight_bytes,
)
from services.worker.repository.loader import load_model
from services.worker.repository.store import load_manifest, version_dir, write_manifest
from services.worker.step_executor import StepExecutor
from services.worker.work import ErrorCode, RunStep, SequenceStep
from tests.support.st_checkpoints import reference_embeddings, save_embedding_directory

OPTIONS = ImportOptions("emb", "1", kv_cache_bytes=1 << 20, max_num_batched_tokens=16)
TOLERANCE = 1e-4  # float32 paged chunks against one dense transformers forward (they agree to ~1e-6 here)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_embedding_directory(tmp_path_factory.mktemp("st") / "src", pooling="mean", base_model=True)


@pytest.fixture(scope="module")
def imported(source, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    import_checkpoint(source, root, OPTIONS)
    return root


def copy_of(source: Path, tmp_path: Path) -> Path:
    shutil.copytree(source, tmp_path / "src")
    return tmp_path / "src"


def test_import_records_the_pooling_normalization_and_golden_vectors(imported):
    manifest = load_manifest(imported, "emb", "1")
    spec = manifest.generator.embedding
    assert (spec.pooling, spec.normalize, spec.dimensions, spec.matryoshka) == (Pooling.MEAN, True, 64, False)
    assert manifest.generator.golden == () and len(spec.golden) == 3
    assert manifest.generator.architecture.architecture == "Qwen3Model"
    run_golden_check(load_model(imported, "emb", "1"))


def test_a_worker_computing_in_bfloat16_passes_the_float32_golden_vectors(imported):
    run_golden_check(load_model(imported, "emb", "1", compute_dtype="bfloat16"))


def test_a_changed_golden_vector_fails_the_golden_check(imported, tmp_path):
    shutil.copytree(version_dir(imported, "emb", "1"), tmp_path / "emb" / "1")
    manifest = load_manifest(tmp_path, "emb", "1")
    spec = manifest.generator.embedding
    first = spec.golden[0]
    changed = replace(first, expected=(first.expected[0] + 0.01, *first.expected[1:]))
    spec = replace(spec, golden=(changed, *spec.golden[1:]))
    write_manifest(replace(manifest, generator=replace(manifest.generator, embedding=spec)), tmp_path / "emb" / "1")
    with pytest.raises(Exception, match="golden prompt 0's embedding differs"):
        run_golden_check(load_model(tmp_path, "emb", "1"))


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True})),
     "1_Pooling/config.json: pooling_mode_max_tokens is not supported"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({
        "pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True})), "exactly one of"),
    (lambda d: (d / "1_Pooling" / "config.json").unlink(), "1_Pooling/config.json: missing"),
    (lambda d: (d / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
        {"type": "sentence_transformers.models.Dense", "path": "2_Dense"}])), "sentence_transformers.models.Dense"),
    (lambda d: (d / "modules.json").write_text("{"), "modules.json: not readable JSON"),
    # Deeper than json's recursion: a RecursionError out of the import before, not a refusal.
    (lambda d: (d / "modules.json").write_text("[" * 100_000), "modules.json: not readable JSON"),
    (lambda d: (d / "1_Pooling" / "config.json").write_text("[" * 100_000), "1_Pooling/config.json: not readable"),
    # A string "false" was truthy: mean pooling read as on beside the last token's, or alone where it was meant off.
    (lambda d: (d / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": "false",
                                                                        "pooling_mode_lasttoken": True})),
     "pooling_mode_mean_tokens must be true or false, got 'false'"),
    (lambda d: (d / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Pooling", "path": "../src/1_Pooling"}])), "must be a folder inside"),
    (lambda d: (d / "modules.json").write_text(json.dumps([
        {"type": "sentence_transformers.models.Pooling", "path": str(d / "1_Pooling")}])), "must be a folder inside"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "is_matryoshka": "false"})),
     "is_matryoshka must be true or false, got 'false'"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "matryoshka_dimensions": 64})),
     "matryoshka_dimensions must be a list of positive integers, got 64"),
])
def test_import_refuses_what_it_cannot_pool_naming_the_file(source, tmp_path, change, says):
    directory = copy_of(source, tmp_path)
    change(directory)
    with pytest.raises(ImportRefused, match=says.replace("(", r"\(")):
        import_checkpoint(directory, tmp_path / "repo", OPTIONS)
    assert not (tmp_path / "repo" / "emb").exists()


def test_a_base_model_cannot_be_imported_to_generate_and_is_an_embedding_model_by_default(source, tmp_path):
    directory = copy_of(source, tmp_path)
    (directory / "modules.json").unlink()
    with pytest.raises(ImportRefused, match="Qwen3Model is a base model without an LM head"):
        import_checkpoint(directory, tmp_path / "repo", ImportOptions("emb", "1", kv_cache_bytes=1 << 20,
                                                                      task="generate"))
    manifest = import_checkpoint(directory, tmp_path / "repo", ImportOptions("emb", "2", kv_cache_bytes=1 << 20))
    # vLLM's default for a decoder without sentence-transformers files: the last token, normalized.
    assert (manifest.generator.embedding.pooling, manifest.generator.embedding.normalize) == (Pooling.LAST, True)


def test_a_manifest_with_an_unknown_pooling_is_refused_naming_the_field(imported, tmp_path):
    shutil.copytree(version_dir(imported, "emb", "1"), tmp_path / "emb" / "1")
    path = tmp_path / "emb" / "1" / "manifest.json"
    data = json.loads(path.read_text())
    data["generator"]["embedding"]["pooling"] = "max"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidManifest, match="generator.embedding.pooling"):
        load_manifest(tmp_path, "emb", "1")


@pytest.mark.parametrize("pooling", list(Pooling))
def test_pooling_chunk_by_chunk_equals_pooling_the_whole_prompt(pooling):
    hidden = torch.randn(23, 8, generator=torch.Generator().manual_seed(1))
    spec = PoolingSpec(pooling, normalize=True)
    pooled = PooledSequence(pooling)
    pooled.add(torch.randn(5, 8), 0)  # a first attempt, then a recompute from position 0 (preemption)
    for start in range(0, 23, 7):
        pooled.add(hidden[start:start + 7], start)
    np.testing.assert_allclose(pooled.vector(True), pool_dense(hidden, spec), atol=1e-6)
    with pytest.raises(ValueError, match="starts at position 30, but its chunks so far end at 23"):
        pooled.add(hidden[:2], 30)


def test_the_executor_pools_chunked_prompts_in_shared_steps(source, imported):
    model = load_model(imported, "emb", "1")
    executor = StepExecutor(model.generator, 16, 16, pooling=PoolingSpec(Pooling.MEAN, True))
    short, long = tuple(range(3, 10)), tuple(range(20, 60))
    outputs = []
    for step_id, seqs in enumerate([
        (SequenceStep(1, short, 0, (0,), reset_block_table=True, sample=True),
         SequenceStep(2, long[:16], 0, (1,), reset_block_table=True)),
        (SequenceStep(2, long[16:32], 16, (2,)),),
        (SequenceStep(2, long[32:], 32, (3,), sample=True),),
    ]):
        step_outputs, _ = executor.run(RunStep(step_id, seqs))
        outputs += [o for o in step_outputs if o.embedding]
        assert all(o.token_id is None and o.error is None for o in step_outputs)
    want = reference_embeddings(source, [short, long], pooling="mean", normalize=True)
    assert [o.seq_id for o in outputs] == [1, 2]
    for output, expected in zip(outputs, want, strict=True):
        assert np.max(np.abs(np.asarray(output.embedding) - expected)) <= TOLERANCE


def test_the_executor_fails_a_sequence_whose_chunks_skip_positions(imported):
    model = load_model(imported, "emb", "1")
    executor = StepExecutor(model.generator, 16, 16, pooling=PoolingSpec(Pooling.LAST, True))
    (out,), _ = executor.run(RunStep(1, (SequenceStep(7, tuple(range(3, 19)), 16, (0, 1), reset_block_table=True,
                                                      num_cached_tokens=16, sample=True),)))
    assert out.error is not None and out.error.code == ErrorCode.INVALID_ARGUMENT
    assert "chunks so far end at 0" in out.error.message


def test_the_hello_declares_the_models_embeddings(imported):
    runtime = GeneratorRuntime(load_model(imported, "emb", "1"), num_kv_blocks=16)
    runtime.load()
    hello = runtime.hello("w1")
    assert hello.kind == common_pb2.MODEL_KIND_EMBEDDING
    assert (hello.embedding.dimensions, hello.embedding.normalize, hello.embedding.pooling) == (64, True, "mean")


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Path, Path]:
    """A *ForCausalLM embedding checkpoint whose LM head is its own tensor (Llama: untied), imported."""
    source = save_embedding_directory(tmp_path_factory.mktemp("st_untied") / "src", family="llama", pooling="last")
    root = tmp_path_factory.mktemp("repo_untied")
    import_checkpoint(source, root, OPTIONS)
    return source, root


def test_an_embedding_model_neither_allocates_nor_loads_an_untied_lm_head(untied):
    source, root = untied
    assert not read_config(source).tie_word_embeddings  # the checkpoint stores lm_head.weight
    model = load_model(root, "emb", "1")
    lm = model.generator.lm
    assert lm.lm_head_weight is None and lm.config.embedding_only
    assert not [name for name, _ in lm.named_parameters() if "head" in name]
    run_golden_check(model)
    want = reference_embeddings(source, [tuple(range(3, 30))], pooling="last", normalize=True)
    (got,) = model.generator.embed_paged([tuple(range(3, 30))], PoolingSpec(Pooling.LAST, True), block_size=16)
    assert np.max(np.abs(got - want[0])) <= TOLERANCE


def test_the_import_sizes_an_embedding_model_without_its_lm_head(untied):
    source, root = untied
    manifest = load_manifest(root, "emb", "1")
    config = read_config(source)
    head_bytes = 4 * config.vocab_size * config.d_model
    assert weight_bytes(replace(config, embedding_only=True)) == weight_bytes(config) - head_bytes
    kv_bytes = manifest.envelope.num_kv_blocks * manifest.envelope.block_size * kv_bytes_per_token(config)
    assert manifest.envelope.memory_bytes == weight_bytes(config) - head_bytes + kv_bytes


def test_an_unloaded_lm_head_is_still_hashed_with_its_file(untied, tmp_path):
    _, root = untied
    shutil.copytree(version_dir(root, "emb", "1"), tmp_path / "emb" / "1")
    weights = tmp_path / "emb" / "1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (header_size,) = struct.unpack("<Q", data[:8])
    begin, end = json.loads(data[8:8 + header_size])["lm_head.weight"]["data_offsets"]
    data[8 + header_size + begin] ^= 0xFF  # a byte the embedding model never reads
    weights.write_bytes(bytes(data))
    with pytest.raises(Exception, match="sha256"):
        load_model(tmp_path, "emb", "1")
