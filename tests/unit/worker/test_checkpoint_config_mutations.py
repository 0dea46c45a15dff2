"""Seeded mutations of what a checkpoint brings: AWQ and GPTQ `quantization_config`s (in config.json) and a
sentence-transformers directory's modules.json and 1_Pooling/config.json. Each mutant parses into a sane
scheme, or is refused with the project's error naming the file and field (CheckpointError, ImportRefused),
never another exception. helper-81's offline probe ran 20 000 config and 10 000 directory mutants this way
(it found `bits: 8.0` raising AssertionError and deep nesting raising RecursionError); a few hundred here
keep the property."""

from __future__ import annotations

import copy
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import pytest

from services.worker.hf_text_files import read_hf_text_files
from services.worker.models.awq_gptq_config import IntQuantization
from services.worker.models.llama_config import CheckpointError, LlamaFamilyConfig
from services.worker.models.quantization_config import describe
from services.worker.pooling import Pooling
from services.worker.repository.errors import ImportRefused, InvalidManifest
from services.worker.repository.pinned_file import PinnedFile
from services.worker.repository.st_pooling import read_st_embedding
from services.worker.repository.tokenizer_spec import HFTokenizerSpec
from tests.unit.worker.models.test_llama_checkpoint_errors import llama_config

NUM_CONFIGS = 400
NUM_DIRECTORIES = 120
SEED = 81

QUANTIZATION_CONFIGS = [  # as AutoAWQ / transformers, AutoAWQ's own spelling, AutoGPTQ and GPTQModel write them
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM",
     "modules_to_not_convert": None, "do_fuse": False},
    {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "gemm"},
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "damp_percent": 0.01},
    {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False, "checkpoint_format": "gptq_v2",
     "pack_dtype": "int32", "dynamic": None, "meta": {"quantizer": ["gptqmodel:2.0.0"]}},
]
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
POOLING = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
           "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
KEYS = ["quant_method", "bits", "w_bit", "group_size", "q_group_size", "zero_point", "version", "backend", "desc_act",
        "checkpoint_format", "is_marlin_format", "pack_dtype", "dynamic", "modules_to_not_convert", "path", "type",
        "pooling_mode_mean_tokens", "pooling_mode_lasttoken", "pooling_mode_max_tokens"]
VALUES = [None, True, False, 0, 1, -1, 3, 4, 8, 128, 2**63, -(10**30), 4.0, 8.0, 4.5, float("nan"), float("inf"), "",
          "4", "gemm", "gptq_v2", "awq", "int32", "false", "\x00", "/etc", "..", "1_Pooling", [], {}, [4], ["lm_head"],
          {"bits": 4}, "sentence_transformers.models.Pooling", "sentence_transformers.models.Dense"]
BROKEN_FILES = ["", "{", "null", "NaN", "[" * 5000, "\ufeff[]"]


def mutated(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """One change: a key set to a hostile value, removed, or mutated inside; a list's item likewise."""
    if isinstance(value, dict) and value and depth < 3:
        value, key = dict(value), rng.choice([*value, *KEYS])
        draw = rng.random()
        if draw < 0.6:
            value[key] = rng.choice(VALUES)
        elif draw < 0.8 or key not in value:
            value.pop(key, None)
        else:
            value[key] = mutated(value[key], rng, depth + 1)
        return value
    if isinstance(value, list) and value and depth < 3:
        value = list(value)
        index = rng.randrange(len(value))
        value[index] = mutated(value[index], rng, depth + 1)
        return value
    return rng.choice(VALUES)


def mutant(base: Any, rng: random.Random) -> Any:
    for _ in range(rng.choice((1, 1, 2, 3))):
        base = mutated(base, rng)
    return base


def test_mutated_quantization_configs_parse_or_are_refused_naming_the_field():
    rng = random.Random(SEED)
    outcomes = {"parsed": 0, "refused": 0}
    for _ in range(NUM_CONFIGS):
        quantization = mutant(copy.deepcopy(rng.choice(QUANTIZATION_CONFIGS)), rng)
        raw = json.loads(json.dumps(llama_config(quantization_config=quantization)))  # as config.json holds it
        try:
            parsed = LlamaFamilyConfig.from_hf(raw, file="dir/config.json").quantization
        except CheckpointError as err:
            assert err.field.startswith("quantization_config"), (quantization, str(err))
            outcomes["refused"] += 1
            continue
        if isinstance(parsed, IntQuantization):
            assert type(parsed.bits) is int and parsed.bits in (4, 8), quantization
            assert parsed.group_size is None or (type(parsed.group_size) is int and parsed.group_size >= 1)
            describe(parsed)
            parsed.layout_problem((64, 128))
        outcomes["parsed"] += 1
    assert min(outcomes.values()) >= NUM_CONFIGS // 10, outcomes  # the mutants reach both sides


def test_mutated_sentence_transformers_files_parse_or_are_refused_naming_the_file(tmp_path):
    rng = random.Random(SEED)
    outcomes = {"parsed": 0, "refused": 0}
    for index in range(NUM_DIRECTORIES):
        directory = tmp_path / str(index)
        (directory / "1_Pooling").mkdir(parents=True)
        files = {"modules.json": MODULES, "1_Pooling/config.json": POOLING}
        name = rng.choice(list(files))
        text = rng.choice(BROKEN_FILES) if rng.random() < 0.1 else json.dumps(mutant(files[name], rng))
        for file, content in files.items():
            (directory / file).write_text(text if file == name else json.dumps(content))
        config = {"is_matryoshka": rng.choice(VALUES)} if rng.random() < 0.2 else {}
        try:
            parsed = read_st_embedding(directory, config)
        except ImportRefused as err:
            assert "modules.json" in str(err) or "config.json" in str(err), str(err)
            outcomes["refused"] += 1
            continue
        assert parsed is not None and isinstance(parsed.pooling, Pooling)
        assert type(parsed.normalize) is bool and type(parsed.matryoshka) is bool
        outcomes["parsed"] += 1
    assert min(outcomes.values()) >= NUM_DIRECTORIES // 10, outcomes


@pytest.mark.parametrize("text", ["[" * 100_000, "{\"a\": " * 100_000])
def test_a_modules_json_nested_past_jsons_recursion_is_refused(tmp_path, text):
    (tmp_path / "modules.json").write_text(text)
    with pytest.raises(ImportRefused, match="modules.json: not readable JSON"):
        read_st_embedding(tmp_path, {})


def test_a_pooling_path_outside_the_directory_is_refused(tmp_path: Path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "config.json").write_text(json.dumps(POOLING))
    directory = tmp_path / "model"
    directory.mkdir()
    for path in (str(outside), "../elsewhere"):
        (directory / "modules.json").write_text(json.dumps([{**MODULES[1], "path": path}]))
        with pytest.raises(ImportRefused, match="must be a folder inside the checkpoint directory"):
            read_st_embedding(directory, {})


def test_a_tokenizer_config_nested_past_jsons_recursion_is_refused_at_the_workers_load(tmp_path: Path):
    """The import reads it for its chat template (and takes none from an unreadable one); the worker reads it
    again at load, where it was a RecursionError instead of the manifest error naming the file."""
    files = {"tokenizer.json": "{}", "tokenizer_config.json": "[" * 100_000}
    pinned = {}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        pinned[name] = PinnedFile(name, hashlib.sha256(text.encode()).hexdigest())
    spec = HFTokenizerSpec("hf", 300, 0, -1, (), pinned["tokenizer.json"], pinned["tokenizer_config.json"], None)
    with pytest.raises(InvalidManifest, match="tokenizer_config.json: not valid JSON"):
        read_hf_text_files(tmp_path, spec)
