"""A Hugging Face Llama-family checkpoint directory → a loaded `LlamaFamilyLM`.

The directory holds `config.json` and the weights as `model.safetensors`, or
shards listed by `model.safetensors.index.json`. Weights are read with
`safetensors` (memory-mapped, no pickle). Before any tensor data is read,
every file's header is checked against the config: each expected tensor
present once, nothing unexpected, each shape what the config implies, each
dtype float32, float16 or bfloat16 and the one the config declares. A
checkpoint that fails is refused whole with a `CheckpointError` naming the
file and the tensor (or config field); nothing is served half-loaded.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.worker.models.llama_config import CheckpointError, LlamaFamilyConfig
from services.worker.models.llama_family import LlamaFamilyLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names → torch's, for the storage dtypes the family is served from.
STORAGE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Older checkpoints saved RoPE's computed inverse frequencies; they follow from the config, so a
# stored copy is skipped (the config's are used).
_DERIVED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def read_config(directory: str | Path, *, max_seq_len: int | None = None) -> LlamaFamilyConfig:
    """The directory's `config.json`, parsed and checked (see `LlamaFamilyConfig.from_hf`)."""
    path = Path(directory) / CONFIG_FILE
    return LlamaFamilyConfig.from_hf(_read_json(path), max_seq_len=max_seq_len, file=str(path))


def expected_tensors(config: LlamaFamilyConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config stores, by name, with its shape."""
    c = config
    q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.d_model)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.d_model,)
        shapes[p + "self_attn.q_proj.weight"] = (q_size, c.d_model)
        shapes[p + "self_attn.k_proj.weight"] = (kv_size, c.d_model)
        shapes[p + "self_attn.v_proj.weight"] = (kv_size, c.d_model)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (c.d_model, q_size)
        shapes[p + "post_attention_layernorm.weight"] = (c.d_model,)
        shapes[p + "mlp.gate_proj.weight"] = (c.d_ff, c.d_model)
        shapes[p + "mlp.up_proj.weight"] = (c.d_ff, c.d_model)
        shapes[p + "mlp.down_proj.weight"] = (c.d_model, c.d_ff)
    shapes["model.norm.weight"] = (c.d_model,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.d_model)
    return shapes


def check_weights(directory: str | Path, config: LlamaFamilyConfig) -> dict[str, Path]:
    """Checks every weight file's header against `config` (no tensor data is read) and returns the
    file holding each expected tensor. CheckpointError names the file and tensor of the first problem."""
    expected = expected_tensors(config)
    where: dict[str, Path] = {}
    storage_dtype: tuple[str, Path, str] | None = None  # (dtype, file, tensor) of the first tensor seen
    files = _weight_files(Path(directory))
    for path, names in files.items():
        with _open(path) as weights:
            stored = set(weights.keys())
            if names is not None:
                absent = sorted(names - stored)
                if absent:
                    raise CheckpointError(str(path), absent[0], f"listed in {WEIGHTS_INDEX_FILE} but not in the file")
                stored = names  # a shard's tensors the index assigns elsewhere are not its to give
            for name in sorted(stored):
                if _DERIVED_TENSOR.fullmatch(name):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding matrix is the head; a stored copy is not used
                if name not in expected:
                    raise CheckpointError(str(path), name, f"unexpected tensor for {config.architecture} "
                                          f"({config.num_layers} layers, qkv_bias={config.qkv_bias}, "
                                          f"tie_word_embeddings={config.tie_word_embeddings})")
                if name in where:
                    raise CheckpointError(str(path), name, f"also stored in {where[name]}")
                tensor = weights.get_slice(name)
                shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
                if shape != expected[name]:
                    raise CheckpointError(str(path), name, f"shape {list(shape)} but config.json implies "
                                          f"{list(expected[name])}")
                if dtype not in STORAGE_DTYPES:
                    raise CheckpointError(str(path), name, f"dtype {dtype} is not supported; supported: "
                                          f"{', '.join(STORAGE_DTYPES)}")
                declared = config.storage_dtype
                if declared is not None and STORAGE_DTYPES[dtype] != declared:
                    raise CheckpointError(str(path), name, f"dtype {dtype} ({STORAGE_DTYPES[dtype]}) but "
                                          f"config.json declares {declared}")
                if storage_dtype is None:
                    storage_dtype = (dtype, path, name)
                elif dtype != storage_dtype[0]:
                    raise CheckpointError(str(path), name, f"dtype {dtype} but {storage_dtype[2]} in "
                                          f"{storage_dtype[1]} is {storage_dtype[0]}: one storage dtype per checkpoint")
                where[name] = path
    missing = sorted(expected.keys() - where.keys())
    if missing:
        raise CheckpointError(", ".join(sorted(str(p) for p in files)), missing[0], f"missing ({len(missing)} expected tensors missing in all)")
    return where


def load_llama_family(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", max_seq_len: int | None = None) -> LlamaFamilyLM:
    """Reads and checks the checkpoint in `directory` and returns its model in eval mode, weights cast to
    `dtype` on `device`. CheckpointError (a ValueError) for anything refused; nothing half-loaded escapes."""
    config = read_config(directory, max_seq_len=max_seq_len)
    where = check_weights(directory, config)
    model = LlamaFamilyLM(config, dtype=dtype, device=device)
    with contextlib.ExitStack() as files, torch.no_grad():
        handles = {path: files.enter_context(_open(path)) for path in set(where.values())}
        _fill(model, lambda name: handles[where[name]].get_tensor(name))
    return model.eval()


def _fill(model: LlamaFamilyLM, read: Callable[[str], torch.Tensor]) -> None:
    """Copies checkpoint tensors into the model's (fused) parameters, casting to its dtype."""
    c = model.config
    model.embed_weight.copy_(read("model.embed_tokens.weight"))
    q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    qkv_rows = {"q": slice(0, q_size), "k": slice(q_size, q_size + kv_size), "v": slice(q_size + kv_size, None)}
    for i, layer in enumerate(model.blocks()):
        p = f"model.layers.{i}."
        layer.attn_norm.copy_(read(p + "input_layernorm.weight"))
        for part, rows in qkv_rows.items():
            layer.qkv_weight[rows].copy_(read(f"{p}self_attn.{part}_proj.weight"))
            if layer.qkv_bias is not None:
                layer.qkv_bias[rows].copy_(read(f"{p}self_attn.{part}_proj.bias"))
        layer.o_weight.copy_(read(p + "self_attn.o_proj.weight"))
        layer.mlp_norm.copy_(read(p + "post_attention_layernorm.weight"))
        layer.gate_up_weight[: c.d_ff].copy_(read(p + "mlp.gate_proj.weight"))
        layer.gate_up_weight[c.d_ff:].copy_(read(p + "mlp.up_proj.weight"))
        layer.down_weight.copy_(read(p + "mlp.down_proj.weight"))
    model.final_norm.copy_(read("model.norm.weight"))
    if model.lm_head_weight is not None:
        model.lm_head_weight.copy_(read("lm_head.weight"))


def _weight_files(directory: Path) -> dict[Path, set[str] | None]:
    """Each weight file, with the tensor names the index assigns it (None: a lone file, all its tensors)."""
    index_path = directory / WEIGHTS_INDEX_FILE
    if index_path.exists():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, Mapping) or not weight_map:
            raise CheckpointError(str(index_path), "weight_map", "must be a non-empty object of tensor → file")
        files: dict[Path, set[str] | None] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
                raise CheckpointError(str(index_path), f"weight_map.{name}",
                                      f"must name a .safetensors file in the same directory, got {file!r}")
            names = files.setdefault(directory / file, set())
            assert names is not None
            names.add(name)
        return files
    single = directory / WEIGHTS_FILE
    if not single.exists():
        raise CheckpointError(str(directory), WEIGHTS_FILE, f"neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE} "
                              "is in the checkpoint directory")
    return {single: None}


def _open(path: Path) -> Any:
    """safe_open on `path`, its errors (unreadable file, corrupt header) as CheckpointError."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError: a file we cannot serve from, whatever the cause
        raise CheckpointError(str(path), "header", f"not a readable safetensors file: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(str(path), "(file)", "missing from the checkpoint directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(path), "(file)", f"not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(str(path), "(top level)", f"must be a JSON object, got {type(data).__name__}")
    return data
