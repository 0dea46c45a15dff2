"""A Hugging Face checkpoint directory -> an ordinary repository version (`infermesh models import DIR`).

The directory's files are copied unchanged into `<repository>/<name>/<version>/` and pinned by
the manifest written beside them: the architecture from config.json, the weights' shards, the
tokenizer's files and chat template, EOS and stop ids from generation_config.json, an envelope
whose KV blocks fill a memory budget, and golden cases recorded from our own float32 forward
(the worker replays them before it serves). Everything is checked before anything is written:
config.json's architecture (models/llama_config.py), every safetensors header against it
(models/llama_weights.py), the tokenizer's ids against vocab_size. A refusal is an ImportRefused
naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.reasoning_formats import (
    NO_REASONING_PARSER,
    REASONING_PARSERS,
    reasoning_parser_for_template,
)
from services.worker.hf_text_files import chat_template_of
from services.worker.models.generator import Generator
from services.worker.models.llama_config import QK_NORM_PER_HEAD, CheckpointError, LlamaFamilyConfig
from services.worker.models.llama_weights import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    check_weights,
    load_llama_family,
    read_config,
)
from services.worker.pooling import Pooling
from services.worker.repository.embedding_spec import EmbeddingSpec, GoldenEmbedding
from services.worker.repository.envelope import Envelope
from services.worker.repository.errors import ImportRefused, InvalidManifest
from services.worker.repository.generator_spec import GeneratorSpec, GoldenGeneration
from services.worker.repository.hf_architecture import HFArchitecture
from services.worker.repository.lora_pins import ADAPTER_NAME_RE, LoraPin, pinned_names
from services.worker.repository.lora_spec import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    check_lora_weights,
    read_lora_config,
)
from services.worker.repository.manifest import Manifest, ModelKind
from services.worker.repository.pinned_file import PinnedFile
from services.worker.repository.sampling_defaults import SamplingDefaults
from services.worker.repository.st_pooling import StEmbedding, is_matryoshka, read_st_embedding
from services.worker.repository.store import check_new_version, sha256_of, version_dir, write_manifest
from services.worker.repository.tokenizer_spec import HF, HFTokenizerSpec
from services.worker.repository.weights_spec import SafetensorsWeights

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
KV_CACHE_BYTES_PER_VALUE = 4  # the KV cache is float32 whatever the compute dtype (models/llama_family.py)
# Golden prompts: encoded with the model's own tokenizer, as the scheduler will encode prompts.
GOLDEN_PROMPTS = ("The quick brown fox", "Hello, world! 1 2 3", "Grüße aus Köln 🙂")
GOLDEN_NEW_TOKENS = 8
# A recorded token must beat the runner-up by this much (float32 logits): the worker replays the
# cases on another CPU or thread count, whose rounding must not flip a near tie.
GOLDEN_MIN_MARGIN = 1e-3


@dataclass(frozen=True)
class ImportOptions:
    name: str
    version: str
    kv_cache_bytes: int  # the KV cache's memory budget: num_kv_blocks fills it
    max_seq_len: int | None = None  # None: max_position_embeddings, capped by what the KV budget holds
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    tool_call_parser: str = ""  # the manifest's tokenizer.tool_call_parser ("": told from the chat template)
    # The manifest's tokenizer.reasoning_parser: None: told here from the chat template; "": none.
    reasoning_parser: str | None = None
    # Record generation_config.json's recommended sampling (vLLM's --generation-config auto); False: none.
    generation_config: bool = True
    # TASK_AUTO: an embedding model when the directory is a sentence-transformers one (modules.json) or a
    # base model without an LM head, else a generator; TASK_EMBED / TASK_GENERATE: as said (vLLM's --task).
    task: str = "auto"
    # LoRA adapters pinned beside the model, (name, PEFT directory) each (lora_pins.py).
    lora_adapters: tuple[tuple[str, str], ...] = ()


TASK_AUTO, TASK_EMBED, TASK_GENERATE = "auto", "embed", "generate"
TASKS = (TASK_AUTO, TASK_EMBED, TASK_GENERATE)


def import_checkpoint(source: str | Path, repository: str | Path, options: ImportOptions) -> Manifest:
    """Checks `source`, copies it into the repository as `options.name/options.version` and writes its
    manifest; returns it. Nothing is left behind when it refuses."""
    source = Path(source)
    if not (source / CONFIG_FILE).is_file():
        raise ImportRefused(f"{source}: no {CONFIG_FILE}: not a Hugging Face checkpoint directory")
    try:
        config = read_config(source)
        # Before sizing: an embedding model holds no LM head (LlamaFamilyConfig.embedding_only).
        embedding = _embedding(source, config, options.task)
        embeds = embedding is not None
        envelope, max_seq_len = _envelope(dataclasses.replace(config, embedding_only=embeds), options)
        # sliding windows read against this length
        config = read_config(source, max_seq_len=max_seq_len, embedding_only=embeds)
        check_weights(source, config)
        _check_lora_adapters(options.lora_adapters, config, embeds, options.name)
    except CheckpointError as exc:
        raise ImportRefused(str(exc)) from None
    tokenizer_json = source / TOKENIZER_FILE
    if not tokenizer_json.is_file():
        raise ImportRefused(f"{tokenizer_json}: missing: the model's tokenizer (tokenizers' tokenizer.json) is "
                            "required; a slow-tokenizer-only checkpoint can be converted with transformers' "
                            "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
    eos, stops, bos = _end_ids(source, config)
    sampling_defaults = _sampling_defaults(source) if options.generation_config else SamplingDefaults()
    _check_tokenizer(tokenizer_json, config.vocab_size, (eos, *stops))
    target = version_dir(repository, options.name, options.version)
    check_new_version(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{options.version}.", dir=_parent(target)))
    try:
        files = _copy_files(source, staging)
        adapters = _copy_lora_adapters(options.lora_adapters, staging)
        if embedding is None:
            golden = _record_golden(staging, tokenizer_json.read_bytes(), max_seq_len, envelope, adapters)
        else:
            golden, embedding = (), _record_golden_embeddings(staging, tokenizer_json.read_bytes(), max_seq_len,
                                                              envelope, embedding)
        manifest = Manifest(
            name=options.name, version=options.version, kind=ModelKind.GENERATOR,
            weights=SafetensorsWeights(tuple(files[n] for n in sorted(files) if n.endswith(".safetensors")),
                                       files.get(WEIGHTS_INDEX_FILE)),
            envelope=envelope,
            generator=GeneratorSpec(
                max_seq_len=max_seq_len,
                tokenizer=HFTokenizerSpec(HF, config.vocab_size, eos, -1 if bos is None else bos, stops,
                                          files[TOKENIZER_FILE], files.get(TOKENIZER_CONFIG_FILE),
                                          files.get(CHAT_TEMPLATE_FILE), options.tool_call_parser,
                                          _reasoning_parser(source, options.reasoning_parser)),
                architecture=HFArchitecture(files[CONFIG_FILE], config.architecture, config.vocab_size),
                golden=golden,
                sampling_defaults=sampling_defaults,
                embedding=embedding,
                lora_adapters=adapters,
            ),
            build={"tool": "infermesh models import", "source": str(source.resolve())},
        )
        write_manifest(manifest, staging)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _embedding(source: Path, config: LlamaFamilyConfig, task: str) -> EmbeddingSpec | None:
    """The embedding the checkpoint serves (its golden cases still to record), or None for a generator of text."""
    if task not in TASKS:
        raise ImportRefused(f"--task must be one of {', '.join(TASKS)}, got {task!r}")
    raw = _json_object(source / CONFIG_FILE)
    st = read_st_embedding(source, raw)
    if task == TASK_GENERATE:
        if config.base_model:
            raise ImportRefused(f"{source / CONFIG_FILE}: architectures[0] {config.architecture} is a base model "
                                "without an LM head: it cannot generate text (import it with --task embed)")
        return None
    if task == TASK_AUTO and st is None and not config.base_model:
        return None
    # vLLM's default for a decoder embedding model without sentence-transformers files: last token, normalized.
    st = st or StEmbedding(Pooling.LAST, normalize=True, matryoshka=is_matryoshka(raw))
    return EmbeddingSpec(st.pooling, st.normalize, config.d_model, st.matryoshka)


def _record_golden_embeddings(directory: Path, tokenizer_json: bytes, max_seq_len: int, envelope: Envelope,
                              spec: EmbeddingSpec) -> EmbeddingSpec:
    """`spec` with the golden prompts' vectors through the paged path and the pooling, as the worker's golden
    check runs them."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    lm = load_llama_family(directory, dtype=torch.float32, max_seq_len=max_seq_len, embedding_only=True)
    generator = Generator(lm, max_seq_len=max_seq_len, eos_token_id=0, bos_token_id=None)
    prompts = [p for p in (tuple(tokenizer.encode(text).ids)[:max_seq_len] for text in GOLDEN_PROMPTS) if p]
    if not prompts:
        raise ImportRefused(f"{directory}: the tokenizer encodes every golden prompt as no token")
    vectors = generator.embed_paged(prompts, spec.pooling_spec, block_size=envelope.block_size,
                                    prefill_chunk=max(1, envelope.max_num_batched_tokens // 2))
    golden = tuple(GoldenEmbedding(p, tuple(float(x) for x in v)) for p, v in zip(prompts, vectors, strict=True))
    return dataclasses.replace(spec, golden=golden)


def _reasoning_parser(source: Path, given: str | None) -> str:
    """The parser given, else the one the chat template implies (chat_template.jinja, else
    tokenizer_config.json's); a template that cannot be read is the worker's to refuse, as today."""
    if given is not None:
        if given and given not in REASONING_PARSERS:
            raise ImportRefused(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} or "
                                f"{NO_REASONING_PARSER}, got {given!r}")
        return given
    return reasoning_parser_for_template(chat_template_text(source))


def chat_template_text(source: Path) -> str:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's; "" when it has
    none or it cannot be read (the worker refuses an unreadable one, as today)."""
    template_file = source / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8", errors="replace")
    config_file = source / TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return ""
    try:
        return chat_template_of(_json_object(config_file), str(config_file))
    except (InvalidManifest, ImportRefused):
        return ""


def kv_bytes_per_token(config: LlamaFamilyConfig) -> int:
    """Keys and values of every layer for one token."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_size * KV_CACHE_BYTES_PER_VALUE


def weight_bytes(config: LlamaFamilyConfig, bytes_per_value: int = 4) -> int:
    """Parameters the worker holds, at float32 (the default compute dtype): every expert of a mixture
    of experts too (each worker holds them all; no expert parallelism), and a quantized checkpoint's
    weights as dequantized at load (4 bytes a value, not FP8's 1 or AWQ's and GPTQ's half; the scales
    and zeros are not kept). An embedding model (embedding_only) holds no LM head."""
    c = config
    attention = c.d_model * (c.num_heads + 2 * c.num_kv_heads) * c.head_size + c.num_heads * c.head_size * c.d_model
    if c.qkv_bias:
        attention += (c.num_heads + 2 * c.num_kv_heads) * c.head_size
    if c.qk_norm == QK_NORM_PER_HEAD:
        attention += 2 * c.head_size
    elif c.qk_norm:
        attention += (c.num_heads + c.num_kv_heads) * c.head_size
    num_norms = (2 if c.pre_norms else 0) + (2 if c.post_norms else 0)
    layer = attention + num_norms * c.d_model
    mlps = sum(_mlp_values(c, i) for i in range(c.num_layers))
    heads = 2 if c.holds_lm_head else 1  # the embedding matrix, and a head of its own if it holds one
    return bytes_per_value * (c.num_layers * layer + mlps + heads * c.vocab_size * c.d_model + c.d_model)


def _mlp_values(config: LlamaFamilyConfig, layer: int) -> int:
    """A layer's MLP parameters: the dense gated MLP's, or every expert's with the router (and a
    shared expert with its gate)."""
    c, e = config, config.experts
    if e is None or not c.has_experts(layer):
        return 3 * c.d_model * c.d_ff
    shared = 3 * c.d_model * e.shared_d_ff + c.d_model if e.shared_d_ff else 0
    return e.num_experts * (3 * c.d_model * e.d_ff + c.d_model) + shared


def _envelope(config: LlamaFamilyConfig, options: ImportOptions) -> tuple[Envelope, int]:
    per_block = kv_bytes_per_token(config) * options.block_size
    num_kv_blocks = options.kv_cache_bytes // per_block
    fits = num_kv_blocks * options.block_size
    max_seq_len = options.max_seq_len or min(config.max_position_embeddings, fits)
    if max_seq_len > config.max_position_embeddings:
        raise ImportRefused(f"--max-seq-len {max_seq_len} exceeds config.json's max_position_embeddings "
                            f"{config.max_position_embeddings}")
    if fits < max(max_seq_len, 1) or num_kv_blocks < 1:
        raise ImportRefused(
            f"--kv-cache-gb {options.kv_cache_bytes / 2**30:g} holds {fits} tokens ({num_kv_blocks} blocks of "
            f"{options.block_size}, {per_block} bytes each), fewer than one sequence of max_seq_len {max_seq_len}: "
            "raise --kv-cache-gb or lower --max-seq-len")
    envelope = Envelope(
        max_batch_size=0, max_num_seqs=options.max_num_seqs, max_num_batched_tokens=options.max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks, block_size=options.block_size,
        memory_bytes=weight_bytes(config) + num_kv_blocks * per_block,
    )
    return envelope, max_seq_len


def _end_ids(source: Path, config: LlamaFamilyConfig) -> tuple[int, tuple[int, ...], int | None]:
    """(eos, further stop ids, bos) from generation_config.json, else config.json (whose vision + text
    form may say them only in its text_config, as transformers 5 writes Gemma 3's)."""
    path = source / GENERATION_CONFIG_FILE
    if not path.is_file():
        path = source / CONFIG_FILE
    data = _json_object(path)
    text_config = data.get("text_config") if path.name == CONFIG_FILE else None
    if data.get("eos_token_id") is None and isinstance(text_config, dict):
        data = {**text_config, **{k: v for k, v in data.items() if v is not None}}
    eos = data.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    if not eos_ids or not all(_is_id(i, config.vocab_size) for i in eos_ids) or len(set(eos_ids)) != len(eos_ids):
        raise ImportRefused(f"{path}: eos_token_id must be a token id, or a list of distinct ones, below "
                            f"vocab_size {config.vocab_size}; got {eos!r}")
    bos = data.get("bos_token_id")
    if bos is not None and not _is_id(bos, config.vocab_size):
        raise ImportRefused(f"{path}: bos_token_id must be a token id below vocab_size {config.vocab_size} or "
                            f"null; got {bos!r}")
    ids = [int(i) for i in eos_ids if i is not None]
    return ids[0], tuple(ids[1:]), None if bos is None else int(bos)


def _check_tokenizer(path: Path, vocab_size: int, end_ids: Sequence[int]) -> None:
    """The scheduler builds the tokenizer from this file: refused here rather than at attach."""
    from tokenizers import Tokenizer  # the importer's (CLI's) dependency; the worker only passes the file on

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ImportRefused(f"{path}: not a tokenizer the tokenizers library can load: {exc}") from None
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    num_ids = max(ids, default=-1) + 1
    if num_ids > vocab_size:
        raise ImportRefused(f"{path}: its vocabulary has ids up to {num_ids - 1}, but config.json's vocab_size is "
                            f"{vocab_size}: the tokenizer does not belong to this model")


def _check_lora_adapters(adapters: tuple[tuple[str, str], ...], config: LlamaFamilyConfig, embeds: bool,
                         model_name: str) -> None:
    """ImportRefused (or CheckpointError naming the file and field or tensor) for an adapter not to serve."""
    names = [name for name, _ in adapters]
    if adapters and embeds:
        raise ImportRefused("--lora: an embedding model serves no LoRA adapters")
    for name, directory in adapters:
        if not ADAPTER_NAME_RE.match(name) or names.count(name) > 1 or name == model_name:
            raise ImportRefused(f"--lora {name}={directory}: a name of letters, digits and ._- (after the first), "
                                "given once and not the model's own, is required")
        check_lora_weights(directory, read_lora_config(directory, config), config)


def _copy_lora_adapters(adapters: tuple[tuple[str, str], ...], target: Path) -> tuple[LoraPin, ...]:
    """Each adapter's two files, copied unchanged under their pinned names and hashed."""
    pins = []
    for name, directory in adapters:
        pinned = []
        for original, copy in zip((ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE), pinned_names(name), strict=True):
            shutil.copyfile(Path(directory) / original, target / copy)
            pinned.append(PinnedFile(copy, sha256_of(target / copy)))
        pins.append(LoraPin(name, pinned[0], pinned[1]))
    return tuple(pins)


def _copy_files(source: Path, target: Path) -> dict[str, PinnedFile]:
    """The files the manifest pins, copied unchanged and hashed: config.json, the weights, the tokenizer's."""
    names = [CONFIG_FILE, TOKENIZER_FILE]
    index = source / WEIGHTS_INDEX_FILE
    if index.is_file():
        names.append(WEIGHTS_INDEX_FILE)
        names += sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        names.append(WEIGHTS_FILE)
    names += [n for n in (TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE, GENERATION_CONFIG_FILE) if (source / n).is_file()]
    pinned = {}
    for name in names:
        shutil.copyfile(source / name, target / name)
        pinned[name] = PinnedFile(name, sha256_of(target / name))
    return pinned


def _record_golden(directory: Path, tokenizer_json: bytes, max_seq_len: int, envelope: Envelope,
                   adapters: Sequence[LoraPin] = ()) -> tuple[GoldenGeneration, ...]:
    """Greedy continuations of GOLDEN_PROMPTS through the paged path, as the worker's golden check runs
    them, each cut before the first token whose float32 margin over the runner-up is below
    GOLDEN_MIN_MARGIN; for the base model, then under each of `adapters` (pinned in `directory`)."""
    from tokenizers import Tokenizer

    from services.worker.models.lora import load_lora_adapter

    tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    lm = load_llama_family(directory, dtype=torch.float32, max_seq_len=max_seq_len)
    generator = Generator(lm, max_seq_len=max_seq_len, eos_token_id=0, bos_token_id=None)
    for pin in adapters:
        generator.add_lora(load_lora_adapter(pin.name, directory, lm.config, config_file=pin.config.file,
                                             weights_file=pin.weights.file))
    cases = []
    for adapter in ("", *(pin.name for pin in adapters)):
        found = []
        for text in GOLDEN_PROMPTS:
            prompt = tuple(tokenizer.encode(text).ids)[: max_seq_len - GOLDEN_NEW_TOKENS]
            if not prompt:
                continue
            chunk = max(1, envelope.max_num_batched_tokens // 2)
            tokens = generator.greedy_paged(prompt, GOLDEN_NEW_TOKENS, block_size=envelope.block_size,
                                            prefill_chunk=chunk) if not adapter else generator.greedy_paged_batch(
                [prompt], [GOLDEN_NEW_TOKENS], block_size=envelope.block_size, prefill_chunk=chunk,
                adapters=[adapter])[0]
            kept = _clear_prefix(generator, prompt, tokens, adapter)
            if kept:
                found.append(GoldenGeneration(prompt, tuple(kept), adapter))
        if not found:
            under = f" under LoRA adapter {adapter!r}" if adapter else ""
            raise ImportRefused(f"{directory}: every golden prompt's first token{under} is a near tie (top-two "
                                f"logits within {GOLDEN_MIN_MARGIN}): no golden case can be recorded reliably")
        cases += found
    return tuple(cases)


def _clear_prefix(generator: Generator, prompt: Sequence[int], tokens: Sequence[int], adapter: str = "") -> list[int]:
    kept: list[int] = []
    with torch.no_grad():
        # Under an adapter through the paged step (the dense reference runs the base model only).
        logits = (generator.paged_logits([*prompt, *tokens], adapter) if adapter
                  else generator.dense_logits([*prompt, *tokens]))[len(prompt) - 1:]
    for token, row in zip(tokens, logits, strict=False):
        top = torch.topk(row.float(), 2).values
        if int(row.argmax()) != token or float(top[0] - top[1]) < GOLDEN_MIN_MARGIN:
            break
        kept.append(token)
    return kept


def _parent(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    return target.parent


def _is_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def _sampling_defaults(source: Path) -> SamplingDefaults:
    """generation_config.json's recommended sampling (none without the file)."""
    path = source / GENERATION_CONFIG_FILE
    if not path.is_file():
        return SamplingDefaults()
    try:
        return SamplingDefaults.from_generation_config(_json_object(path), str(path))
    except ValueError as exc:
        raise ImportRefused(str(exc)) from None


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # Recursion: too deep
        raise ImportRefused(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ImportRefused(f"{path}: must be a JSON object, got {type(data).__name__}")
    return data
