"""A Hugging Face Llama-family checkpoint directory → a loaded `LlamaFamilyLM`.

The directory holds `config.json` and the weights as `model.safetensors`, or
shards listed by `model.safetensors.index.json` (safetensors: a JSON header
and raw little-endian tensor bytes, no pickle). Before any tensor data is
read, every file's header is checked against the config (with `safetensors`'
own reader): each expected tensor present once, nothing unexpected, each
shape what the config implies, each dtype float32, float16 or bfloat16 and
the one the config declares (in an FP8 checkpoint a Linear weight may instead
be float8_e4m3fn, its scale beside it: fp8_weights checks the pairs; in an AWQ
or GPTQ checkpoint it is stored as packed integers, scales and zeros instead:
awq_gptq_weights checks the parts). Then each file is read once, front to back,
into the parameters (a quantized weight's stored tensors land in host memory,
and are dequantized into its place once all are read) and hashed on the way (on
a second thread: pipelined_digest), so loading costs one pass over the bytes
(not a hash pass, then a memory-mapped pass and a copy). A checkpoint that fails
is refused whole with a `CheckpointError` naming the file and the tensor (or
config field); nothing is served half-loaded.

A mixture-of-experts checkpoint stores its experts per expert (as released)
or stacked (transformers 5's layout); expert_weights names both, and either is
read into the same stacked parameters.

A multimodal checkpoint served text-only (Gemma3ForConditionalGeneration)
stores the language model's tensors under a prefix, read as the text model's
names, beside a vision tower and projector that are hashed with their file but
never loaded.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.worker.models.awq_gptq_config import IntQuantization
from services.worker.models.awq_gptq_weights import PACKED_DTYPE, IntGroup, IntTensors, IntWeight
from services.worker.models.expert_weights import expert_places, expert_shape, expert_view, stores_stacked
from services.worker.models.fp8_config import Fp8Quantization
from services.worker.models.fp8_weights import QUANTIZED_DTYPE, Fp8Pair, Fp8Tensors, StoredTensor
from services.worker.models.llama_config import QK_NORM_PER_HEAD, CheckpointError, LlamaFamilyConfig
from services.worker.models.llama_family import LlamaFamilyLM
from services.worker.models.pipelined_digest import PipelinedSha256
from services.worker.models.quantization_config import Quantization

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
# safetensors' dtype names → torch's, for the storage dtypes the family is served from.
STORAGE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Every dtype a loaded tensor may be stored in: the storage dtypes, an FP8 checkpoint's float8 weights,
# and an AWQ or GPTQ checkpoint's packed integers.
_READ_DTYPES = {**STORAGE_DTYPES, QUANTIZED_DTYPE: "float8_e4m3fn", PACKED_DTYPE: "int32"}
# Older checkpoints saved RoPE's computed inverse frequencies; they follow from the config, so a
# stored copy is skipped (the config's are used).
_DERIVED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# A multimodal checkpoint's language model: transformers 4's hub names (language_model.model.*,
# language_model.lm_head.weight) or 5's module paths (model.language_model.*, lm_head.weight).
_LANGUAGE_MODEL = re.compile(r"(?:language_model\.model|model\.language_model)\.(.+)")
_LANGUAGE_MODEL_HEADS = ("language_model.lm_head.weight", "lm_head.weight")
# Its image side, in either spelling: stored, not served (text prompts only).
_IMAGE_SIDE = re.compile(r"(?:model\.)?(?:vision_tower|multi_modal_projector)\..+")
# Weight files are read and hashed in pieces this size: large enough for few system calls, small
# enough that a piece is still in the CPU's cache when it is hashed.
_CHUNK_BYTES = 4 << 20
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_MIXTRAL = "MixtralForCausalLM"  # names its experts its own way (expert_weights)


def read_config(directory: str | Path, *, max_seq_len: int | None = None,
                embedding_only: bool = False) -> LlamaFamilyConfig:
    """The directory's `config.json`, parsed and checked (see `LlamaFamilyConfig.from_hf`); `embedding_only`:
    to be served as an embedding model (LlamaFamilyConfig.embedding_only: no LM head)."""
    path = Path(directory) / CONFIG_FILE
    config = LlamaFamilyConfig.from_hf(_read_json(path), max_seq_len=max_seq_len, file=str(path))
    return replace(config, embedding_only=True) if embedding_only else config


def expected_tensors(config: LlamaFamilyConfig, *, stacked_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config stores, by name, with its shape; a mixture of experts'
    in the layout `stacked_experts` says (expert_weights)."""
    c = config
    q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.d_model)}
    places = {} if c.experts is None else expert_places(c.experts, mixtral=c.architecture == _MIXTRAL,
                                                          stacked=stacked_experts)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for name in norm_names(c).values():
            shapes[p + name] = (c.d_model,)
        if c.fused_projections:
            shapes[p + "self_attn.qkv_proj.weight"] = (q_size + 2 * kv_size, c.d_model)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_size, c.d_model)
            shapes[p + "self_attn.k_proj.weight"] = (kv_size, c.d_model)
            shapes[p + "self_attn.v_proj.weight"] = (kv_size, c.d_model)
        if c.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_size,)
        if c.qk_norm:
            per_head = c.qk_norm == QK_NORM_PER_HEAD
            shapes[p + "self_attn.q_norm.weight"] = (c.head_size if per_head else q_size,)
            shapes[p + "self_attn.k_norm.weight"] = (c.head_size if per_head else kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (c.d_model, q_size)
        if c.experts is not None and c.has_experts(i):
            shapes.update({p + name: expert_shape(place, c.experts, c.d_model) for name, place in places.items()})
            continue
        if c.fused_projections:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * c.d_ff, c.d_model)  # gate's rows, then up's
        else:
            shapes[p + "mlp.gate_proj.weight"] = (c.d_ff, c.d_model)
            shapes[p + "mlp.up_proj.weight"] = (c.d_ff, c.d_model)
        shapes[p + "mlp.down_proj.weight"] = (c.d_model, c.d_ff)
    shapes["model.norm.weight"] = (c.d_model,)
    if c.holds_lm_head:
        shapes["lm_head.weight"] = (c.vocab_size, c.d_model)
    return shapes


def norm_names(config: LlamaFamilyConfig) -> dict[str, str]:
    """Each of a layer's branch norms (LlamaFamilyBlock's attribute) → the checkpoint's name for it. Llama
    normalizes each branch's input (input_layernorm, post_attention_layernorm), OLMo 2 each branch's
    output (post_attention_layernorm, post_feedforward_layernorm), Gemma both (and pre_feedforward_layernorm)."""
    names: dict[str, str] = {}
    if config.pre_norms:
        names["attn_norm"] = "input_layernorm.weight"
        names["mlp_norm"] = "pre_feedforward_layernorm.weight" if config.post_norms else "post_attention_layernorm.weight"
    if config.post_norms:
        names["attn_post_norm"] = "post_attention_layernorm.weight"
        names["mlp_post_norm"] = "post_feedforward_layernorm.weight"
    return names


@dataclass(frozen=True)
class CheckedWeights:
    """Where a checked checkpoint's tensors are, by the model's names for them."""

    where: dict[str, tuple[Path, str]]  # each expected tensor → its file and its name there
    # An FP8 checkpoint's quantized weights (by the weight's model name) → their scales; {}: none.
    scales: dict[str, StoredTensor]
    # An AWQ or GPTQ checkpoint's quantized weights (by the weight's model name; not in `where`, as no
    # tensor of that name is stored) → their stored parts; {}: none.
    packed: dict[str, IntWeight] = field(default_factory=dict)


def check_weights(directory: str | Path, config: LlamaFamilyConfig) -> CheckedWeights:
    """Checks every weight file's header against `config` (no tensor data is read) and returns where
    each expected tensor is stored, and each quantized weight's scale. CheckpointError names the file
    and tensor (as stored) of the first problem."""
    files = _weight_files(Path(directory))
    stacked = config.experts is not None and stores_stacked(_model_name(n, config) or "" for n in _stored_names(files))
    expected = expected_tensors(config, stacked_experts=stacked)
    quantization = config.quantization
    fp8 = Fp8Tensors(quantization, expected) if isinstance(quantization, Fp8Quantization) else None
    packed = IntTensors(quantization, expected) if isinstance(quantization, IntQuantization) else None
    where: dict[str, tuple[Path, str]] = {}
    storage_dtype: tuple[str, Path, str] | None = None  # (dtype, file, tensor) of the first tensor seen
    for path, names in files.items():
        with _open(path) as weights:
            stored = set(weights.keys())
            if names is not None:
                absent = sorted(names - stored)
                if absent:
                    raise CheckpointError(str(path), absent[0], f"listed in {WEIGHTS_INDEX_FILE} but not in the file")
                stored = names  # a shard's tensors the index assigns elsewhere are not its to give
            for name in sorted(stored):
                model_name = _model_name(name, config)
                if _stored_only(name, model_name, config):
                    continue
                tensor = weights.get_slice(name)
                shape, dtype = tuple(tensor.get_shape()), tensor.get_dtype()
                if fp8 is not None and model_name is not None and fp8.take_scale(
                        model_name, StoredTensor(path, name, shape, dtype)):
                    continue
                if packed is not None and model_name is not None and packed.take(
                        model_name, StoredTensor(path, name, shape, dtype)):
                    continue
                if model_name is None or model_name not in expected:
                    where_from = "" if model_name is not None else (
                        "; a vision + text checkpoint stores its language model under language_model.model. or "
                        "model.language_model.")
                    raise CheckpointError(str(path), name, f"unexpected tensor for {config.architecture} "
                                          f"({config.num_layers} layers, qkv_bias={config.qkv_bias}, qk_norm={config.qk_norm!r}, "
                                          f"pre_norms={config.pre_norms}, post_norms={config.post_norms}, "
                                          f"fused_projections={config.fused_projections}, "
                                          f"tie_word_embeddings={config.tie_word_embeddings}"
                                          f"{_experts_said(config, stacked)}){where_from}")
                if model_name in where:
                    raise CheckpointError(str(path), name, f"the same tensor as {where[model_name][1]} in "
                                          f"{where[model_name][0]}")
                if shape != expected[model_name]:
                    raise CheckpointError(str(path), name, f"shape {list(shape)} but config.json implies "
                                          f"{list(expected[model_name])}")
                where[model_name] = (path, name)
                if fp8 is not None and dtype == QUANTIZED_DTYPE:
                    fp8.add_weight(model_name, StoredTensor(path, name, shape, dtype))
                    continue  # the one storage dtype is the unquantized tensors'
                if dtype not in STORAGE_DTYPES:
                    quantized = f", {QUANTIZED_DTYPE} (quantized Linear weights)" if fp8 is not None else ""
                    if packed is not None:
                        quantized = (f"; a quantized Linear weight is stored as {', '.join(packed.quantization.part_names)}"
                                     " beside each other")
                    raise CheckpointError(str(path), name, f"dtype {dtype} is not supported; supported: "
                                          f"{', '.join(STORAGE_DTYPES)}{quantized}")
                declared = config.storage_dtype
                if declared is not None and STORAGE_DTYPES[dtype] != declared:
                    raise CheckpointError(str(path), name, f"dtype {dtype} ({STORAGE_DTYPES[dtype]}) but "
                                          f"config.json declares {declared}")
                if storage_dtype is None:
                    storage_dtype = (dtype, path, name)
                elif dtype != storage_dtype[0]:
                    raise CheckpointError(str(path), name, f"dtype {dtype} but {storage_dtype[2]} in "
                                          f"{storage_dtype[1]} is {storage_dtype[0]}: one storage dtype per checkpoint")
    packed_weights = {} if packed is None else packed.check(where)
    missing = sorted(expected.keys() - where.keys() - packed_weights.keys())
    if missing:
        raise CheckpointError(", ".join(sorted(str(p) for p in files)), missing[0], f"missing ({len(missing)} expected tensors missing in all)")
    return CheckedWeights(where, {} if fp8 is None else fp8.check(), packed_weights)


def _experts_said(config: LlamaFamilyConfig, stacked: bool) -> str:
    if config.experts is None:
        return ""
    return (f", {config.experts.num_experts} experts on layers {list(config.experts.layers)} stored "
            f"{'stacked (mlp.experts.gate_up_proj)' if stacked else 'per expert'}")


def _stored_names(files: Mapping[Path, set[str] | None]) -> set[str]:
    """Every tensor name the weight files hold: the index's, or each lone file's header's."""
    names: set[str] = set()
    for path, listed in files.items():
        if listed is None:
            with _open(path) as weights:
                listed = set(weights.keys())
        names |= listed
    return names


def _model_name(name: str, config: LlamaFamilyConfig) -> str | None:
    """What the model calls a stored tensor (expected_tensors' names): its stored name, or in a
    multimodal checkpoint the language model's name without its prefix; None for a name the language
    model does not have there."""
    if config.base_model:  # a base model's tensors are the decoder's, without its prefix
        return "model." + name
    if not config.multimodal:
        return name
    if name in _LANGUAGE_MODEL_HEADS:
        return "lm_head.weight"
    match = _LANGUAGE_MODEL.fullmatch(name)
    return None if match is None else "model." + match[1]


def _stored_only(name: str, model_name: str | None, config: LlamaFamilyConfig) -> bool:
    """Whether a checkpoint may store this tensor without the model loading it (it is hashed with its
    file all the same): RoPE's derived frequencies, a tied head's copy, an embedding model's head (never
    used: the final hidden states are pooled), a multimodal image side."""
    if model_name is None:
        return _IMAGE_SIDE.fullmatch(name) is not None
    return bool(_DERIVED_TENSOR.fullmatch(model_name)) or (model_name == "lm_head.weight"
                                                             and (config.tie_word_embeddings or config.embedding_only))


def load_llama_family(directory: str | Path, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", max_seq_len: int | None = None,
                      sha256: dict[Path, str] | None = None, embedding_only: bool = False) -> LlamaFamilyLM:
    """Reads and checks the checkpoint in `directory` and returns its model in eval mode, weights cast to
    `dtype` on `device`. CheckpointError (a ValueError) for anything refused; nothing half-loaded escapes.
    `embedding_only`: the model serves embeddings (LlamaFamilyConfig.embedding_only), so a stored LM head
    is hashed and skipped, never allocated.

    Each weight file is read once, front to back, straight into the parameters where its dtype is the
    compute dtype (on the host), and hashed in the same pass: `sha256`, when given, receives every weight
    file's hex digest, so a caller that pins the files compares them before it serves the model (and the
    bytes it compared are the bytes it serves)."""
    config = read_config(directory, max_seq_len=max_seq_len, embedding_only=embedding_only)
    checked = check_weights(directory, config)
    model = LlamaFamilyLM(config, dtype=dtype, device=device)
    places, pairs = _places(checked, _destinations(model), config.quantization)
    with torch.no_grad():
        for path in sorted({at for at, _ in places}):
            digest = _read_file(path, {stored: place for (at, stored), place in places.items() if at == path})
            if sha256 is not None:
                sha256[path] = digest
    unfilled = [name for name, pair in pairs.items() if not pair.done]
    if unfilled:
        stored = checked.where.get(unfilled[0]) or next(
            (t.path, t.name) for t in checked.packed[unfilled[0]].parts.values())
        raise CheckpointError(str(stored[0]), unfilled[0], "changed since its header was checked: its weight "
                              "or its scale (or packed part) was not read")
    return model.eval()


@dataclass(frozen=True)
class _Landing:
    """A tensor read whole into host memory of its stored dtype and handed to `receive`: an FP8 weight
    or its scale, or an AWQ or GPTQ weight's part, dequantized into the model once all are read.
    `receive` must not change the tensor in place: its bytes may not have been hashed yet."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name, as check_weights saw it
    receive: Callable[[torch.Tensor], None]


def _places(checked: CheckedWeights, destinations: Mapping[str, torch.Tensor],
            quantization: Quantization | None) -> tuple[dict[tuple[Path, str], torch.Tensor | _Landing],
                                                        dict[str, Fp8Pair | IntGroup]]:
    """Where each stored tensor (its file, its name there) goes: its view in the model, or for an FP8
    weight and its scale, or an AWQ or GPTQ weight's parts, a landing that gathers them; and the
    gatherings, by the weight's model name."""
    places: dict[tuple[Path, str], torch.Tensor | _Landing] = {}
    pairs: dict[str, Fp8Pair | IntGroup] = {}
    for name, stored in checked.where.items():
        scale = checked.scales.get(name)
        if scale is None:
            places[stored] = destinations[name]
            continue
        assert isinstance(quantization, Fp8Quantization)  # check_weights finds scales only in an FP8 checkpoint
        pair = Fp8Pair(destinations[name], quantization)
        pairs[name] = pair
        places[stored] = _Landing(tuple(destinations[name].shape), QUANTIZED_DTYPE, pair.receive_weight)
        places[(scale.path, scale.name)] = _Landing(scale.shape, scale.dtype, pair.receive_scale)
    for name, weight in checked.packed.items():
        assert isinstance(quantization, IntQuantization)  # and packed weights only in an AWQ or GPTQ one
        group = IntGroup(destinations[name], quantization, weight)
        pairs[name] = group
        for part, tensor in weight.parts.items():
            places[(tensor.path, tensor.name)] = _Landing(tensor.shape, tensor.dtype, partial(group.receive, part))
    return places, pairs


def _destinations(model: LlamaFamilyLM) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor's place in the model's (fused) parameters: a view it is copied into."""
    c = model.config
    places: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_weight}
    q_size, kv_size = c.num_heads * c.head_size, c.num_kv_heads * c.head_size
    qkv_rows = {"q": slice(0, q_size), "k": slice(q_size, q_size + kv_size), "v": slice(q_size + kv_size, None)}
    for i, layer in enumerate(model.blocks()):
        p = f"model.layers.{i}."
        for attribute, name in norm_names(c).items():
            places[p + name] = getattr(layer, attribute)
        if c.fused_projections:
            places[p + "self_attn.qkv_proj.weight"] = layer.qkv_weight
        else:
            for part, rows in qkv_rows.items():
                places[f"{p}self_attn.{part}_proj.weight"] = layer.qkv_weight[rows]
                if layer.qkv_bias is not None:
                    places[f"{p}self_attn.{part}_proj.bias"] = layer.qkv_bias[rows]
        if layer.q_norm is not None and layer.k_norm is not None:
            places[p + "self_attn.q_norm.weight"] = layer.q_norm
            places[p + "self_attn.k_norm.weight"] = layer.k_norm
        places[p + "self_attn.o_proj.weight"] = layer.o_weight
        if layer.experts is not None and c.experts is not None:
            for stacked in (False, True):  # a checkpoint's tensors are named in one of the two layouts
                for name, place in expert_places(c.experts, mixtral=c.architecture == _MIXTRAL,
                                                 stacked=stacked).items():
                    places[p + name] = expert_view(place, layer.experts)
            continue
        assert layer.gate_up_weight is not None and layer.down_weight is not None  # a dense layer
        if c.fused_projections:
            places[p + "mlp.gate_up_proj.weight"] = layer.gate_up_weight
        else:
            places[p + "mlp.gate_proj.weight"] = layer.gate_up_weight[: c.d_ff]
            places[p + "mlp.up_proj.weight"] = layer.gate_up_weight[c.d_ff:]
        places[p + "mlp.down_proj.weight"] = layer.down_weight
    places["model.norm.weight"] = model.final_norm
    if model.lm_head_weight is not None:
        places["lm_head.weight"] = model.lm_head_weight
    return places


def _read_file(path: Path, destinations: Mapping[str, torch.Tensor | _Landing]) -> str:
    """Reads the safetensors file at `path` front to back in one pass, copying each tensor named (as
    stored) in `destinations` into its place, and returns the sha256 of every byte of the file (header, tensors
    used or not, padding). CheckpointError when the file is not what check_weights saw."""
    with PipelinedSha256() as digest, path.open("rb", buffering=0) as f:
        header_bytes = _read_exactly(f, 8, path, digest)
        (header_size,) = struct.unpack("<Q", header_bytes)
        if header_size > _MAX_HEADER_BYTES:
            raise CheckpointError(str(path), "header", f"{header_size} bytes, more than safetensors allows")
        try:
            header = json.loads(_read_exactly(f, header_size, path, digest))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(str(path), "header", f"not JSON: {e}") from None
        entries = _data_entries(header, path)
        position = 0  # within the data section
        for begin, end, name, stored_dtype in entries:
            _skip(f, begin - position, path, digest)
            target = destinations.get(name)
            if target is None:  # a derived or tied tensor, the image side, an input scale: hashed, not kept
                _skip(f, end - begin, path, digest)
            elif isinstance(target, _Landing):
                if stored_dtype != target.dtype:
                    raise CheckpointError(str(path), name, f"changed since its header was checked: dtype {stored_dtype}")
                landing = torch.empty(target.shape, dtype=getattr(torch, _READ_DTYPES[stored_dtype]))
                _read_tensor(f, end - begin, landing, landing.dtype, path, name, digest)
                target.receive(landing)
            elif stored_dtype not in STORAGE_DTYPES:
                raise CheckpointError(str(path), name, f"changed since its header was checked: dtype {stored_dtype}")
            else:
                _read_tensor(f, end - begin, target, getattr(torch, STORAGE_DTYPES[stored_dtype]), path, name, digest)
            position = end
        while tail := f.read(_CHUNK_BYTES):
            digest.update(tail)
        return digest.hexdigest()


def _data_entries(header: Any, path: Path) -> list[tuple[int, int, str, str]]:
    """(begin, end, name, dtype) of each tensor in the data section, by position (a tensor not loaded
    may have any dtype: it is only hashed)."""
    if not isinstance(header, dict):
        raise CheckpointError(str(path), "header", "not a JSON object")
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            (begin, end), dtype = info["data_offsets"], info["dtype"]
            valid = isinstance(dtype, str) and 0 <= int(begin) <= int(end)
        except (TypeError, KeyError, ValueError):
            valid = False
        if not valid:
            raise CheckpointError(str(path), name, f"changed since its header was checked: {info}")
        entries.append((int(begin), int(end), name, dtype))
    entries.sort()
    for (_, end, name, _), (begin, _, _, _) in zip(entries, entries[1:], strict=False):
        if begin < end:
            raise CheckpointError(str(path), name, "overlaps the next tensor's bytes")
    return entries


def _read_tensor(f: Any, size: int, target: torch.Tensor, stored: torch.dtype, path: Path, name: str,
                 digest: Any) -> None:
    """`size` bytes of the file into `target`: straight into its memory when it is host memory of the
    stored dtype, else through a buffer and a cast (or a copy to the device)."""
    if size != target.numel() * stored.itemsize:
        raise CheckpointError(str(path), name, f"{size} bytes, but its shape {list(target.shape)} in "
                              f"{stored} takes {target.numel() * stored.itemsize}")
    direct = target.device.type == "cpu" and target.dtype == stored and target.is_contiguous()
    landing = target if direct else torch.empty(target.shape, dtype=stored)
    view = memoryview(landing.view(-1).view(torch.uint8).numpy().data)
    for at in range(0, size, _CHUNK_BYTES):
        piece = view[at:at + _CHUNK_BYTES]
        if f.readinto(piece) != len(piece):
            raise CheckpointError(str(path), name, "the file ends inside this tensor")
        digest.update(piece)  # hashed on the digest's thread while the next piece is read
    if not direct:
        target.copy_(landing)


def _skip(f: Any, size: int, path: Path, digest: Any) -> None:
    """Reads and hashes `size` bytes nothing keeps (each piece fresh: the digest hashes it later)."""
    while size > 0:
        piece = f.read(min(size, _CHUNK_BYTES))
        if not piece:
            raise CheckpointError(str(path), "data", "the file ends before its tensors do")
        digest.update(piece)
        size -= len(piece)


def _read_exactly(f: Any, size: int, path: Path, digest: Any) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise CheckpointError(str(path), "header", "the file ends inside its header")
    digest.update(data)
    return bytes(data)


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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # Recursion: nested too deep
        raise CheckpointError(str(path), "(file)", f"not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(str(path), "(top level)", f"must be a JSON object, got {type(data).__name__}")
    return data
