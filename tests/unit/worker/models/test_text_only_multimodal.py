"""A vision + text checkpoint (Gemma3ForConditionalGeneration: Gemma 3 4B and up) served text-only: its
logits at every position (dense and paged) are transformers' text-only forward's (input_ids alone), in
either transformers' tensor naming and from a released-style config that leaves most of text_config to
the defaults; its vision tower and projector are hashed with the file but never loaded; anything else
the checkpoint stores is refused as in every checkpoint."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from services.worker.models.llama_config import CheckpointError
from services.worker.models.llama_weights import check_weights, load_llama_family, read_config
from services.worker.repository.hf_import import weight_bytes
from tests.support.hf_checkpoints import save_tiny_checkpoint
from tests.unit.worker.models.test_llama_family import (
    LOGITS_TOLERANCE,
    assert_paged_logits_at_chunk_ends,
    random_ids,
)

IMAGE_SIDE = ("vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def gemma3_vision(tmp_path_factory: pytest.TempPathFactory):
    """(directory, transformers' Gemma3ForConditionalGeneration with the same float32 weights)."""
    directory = tmp_path_factory.mktemp("hf-gemma3-vision")
    return directory, save_tiny_checkpoint(directory, "gemma3_vision")


def renamed_copy(source: Path, target: Path, rename) -> Path:
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    save_file({rename(name): t for name, t in load_file(weights).items()}, weights, metadata={"format": "pt"})
    return target


def module_path_name(name: str) -> str:
    """transformers 5's module paths (the names it loads either spelling into)."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name if name.startswith(IMAGE_SIDE) else name


def test_text_logits_are_transformers_text_only_forward_at_every_position(gemma3_vision):
    directory, reference = gemma3_vision
    lm = load_llama_family(directory)
    ids = random_ids(60, seed=3)
    with torch.inference_mode():
        expected = reference(input_ids=torch.tensor([ids])).logits[0]
        torch.testing.assert_close(lm(torch.tensor([ids]))[0], expected, **LOGITS_TOLERANCE)
    assert_paged_logits_at_chunk_ends(lm, ids, expected)


def test_the_vision_tower_and_projector_are_hashed_with_the_file_but_not_loaded(gemma3_vision):
    directory, reference = gemma3_vision
    config = read_config(directory)
    assert (config.architecture, config.multimodal, config.tie_word_embeddings) == (
        "Gemma3ForConditionalGeneration", True, True)
    weights = directory / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        stored = set(f.keys())
    image_side = {name for name in stored if name.startswith(IMAGE_SIDE)}
    loaded = {name for _, name in check_weights(directory, config).where.values()}
    assert image_side and loaded == stored - image_side
    assert all(name.startswith("language_model.model.") for name in loaded)  # transformers' hub naming

    digests: dict[Path, str] = {}
    lm = load_llama_family(directory, sha256=digests)
    assert digests == {weights: hashlib.sha256(weights.read_bytes()).hexdigest()}
    held = sum(p.numel() * p.element_size() for p in lm.parameters())
    assert held == weight_bytes(lm.config) == 4 * sum(p.numel() for p in reference.model.language_model.parameters())


def test_transformers_5_module_path_names_load_the_same_model(gemma3_vision, tmp_path):
    """model.language_model.*, model.vision_tower.*, a tied head's lm_head.weight (skipped), and an
    integer buffer of the vision tower's (only hashed, so any dtype)."""
    directory, _ = gemma3_vision
    copy = renamed_copy(directory, tmp_path / "renamed", module_path_name)
    weights = copy / "model.safetensors"
    tensors = load_file(weights)
    save_file({**tensors, "lm_head.weight": tensors["model.language_model.embed_tokens.weight"].clone(),
               "model.vision_tower.embeddings.position_ids": torch.arange(4)}, weights, metadata={"format": "pt"})
    assert not any(name.startswith(("language_model.", *IMAGE_SIDE)) for name in load_file(weights))
    assert read_config(copy) == read_config(directory)
    expected, got = load_llama_family(directory).state_dict(), load_llama_family(copy).state_dict()
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.parametrize(("stray", "says"), [
    ("language_model.model.layers.2.input_layernorm.weight", "unexpected tensor for Gemma3ForConditionalGeneration"),
    ("model.embed_tokens.weight", "under language_model.model. or model.language_model."),  # neither spelling
    ("audio_tower.conv.weight", "unexpected tensor"),
    ("model.language_model.norm.weight", "the same tensor as language_model.model.norm.weight in"),
])
def test_anything_but_the_language_model_and_the_image_side_is_refused_naming_it(gemma3_vision, tmp_path, stray,
                                                                                 says):
    directory = tmp_path / "ckpt"
    shutil.copytree(gemma3_vision[0], directory)
    weights = directory / "model.safetensors"
    save_file({**load_file(weights), stray: torch.ones(64)}, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as caught:
        load_llama_family(directory)
    assert (caught.value.file, caught.value.field) == (str(weights), stray) and says in str(caught.value)


def test_a_released_style_config_leaving_text_config_to_the_defaults_reads_the_same(gemma3_vision, tmp_path):
    """As Gemma 3 4B's config.json (transformers 4.50) is written: text_config holds what differs from
    Gemma3TextConfig's defaults, in rope_scaling's spelling; torch_dtype at the top level only."""
    directory = tmp_path / "ckpt"
    shutil.copytree(gemma3_vision[0], directory)
    saved = json.loads((directory / "config.json").read_text())
    text = {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text", "num_hidden_layers": 2,
            "rope_scaling": {"factor": 2.0, "rope_type": "linear"}, "sliding_window": 8, "sliding_window_pattern": 2,
            "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "query_pre_attn_scalar": 24, "max_position_embeddings": 256}
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "text_config": text,
        "torch_dtype": "float32", "vision_config": saved["vision_config"]}))
    assert read_config(directory) == read_config(gemma3_vision[0])
    ids = torch.tensor([random_ids(40, seed=5)])
    with torch.inference_mode():
        torch.testing.assert_close(load_llama_family(directory)(ids), gemma3_vision[1](input_ids=ids).logits,
                                   **LOGITS_TOLERANCE)
