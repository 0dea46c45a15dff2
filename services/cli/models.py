"""`infermesh models import SOURCE --name N --version V`: a model brought from elsewhere into the repository.

What SOURCE is picks the importer (IMPORTERS, keyed by `source_kind`): a TorchScript or ONNX
file becomes a `kind: tensor` version (services/worker/repository/tensor_import.py); a directory
holding config.json, a Hugging Face decoder checkpoint (Llama, Qwen2, Qwen3, Mistral, Phi-3,
Granite, SmolLM3, OLMo 2 families), becomes a generator served with its own tokenizer
(services/worker/repository/hf_import.py). The importers load torch, onnxruntime and tokenizers, so
they are imported only when the command runs.
Exit codes: 0 imported (and golden-checked); 2 refused, with the flag or fix in the message.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.cli.errors import UsageError
from services.common.reasoning_formats import NO_REASONING_PARSER, QWEN3, REASONING_PARSERS
from services.common.tool_call_formats import TOOL_CALL_PARSERS, parser_for_template

if TYPE_CHECKING:  # the worker's modules load torch: imported only when a command runs
    from services.worker.repository.generator_spec import GeneratorSpec

TENSOR = "tensor"
HF = "hf"
TENSOR_SUFFIXES = (".onnx", ".pt", ".pth", ".ts", ".torchscript")


def add_parser(commands) -> None:
    models = commands.add_parser("models", help="bring a model into a model repository")
    actions = models.add_subparsers(dest="action", metavar="ACTION", required=True)
    imported = actions.add_parser(
        "import", help="import a TorchScript (.pt) or ONNX (.onnx) file as a tensor model version, or a Hugging "
                       "Face checkpoint directory as a generator",
        description="Copies the file (or the checkpoint's files) unchanged into REPOSITORY/NAME/VERSION/, writes "
                    "its manifest (a tensor model: inputs and outputs read from the file where it says them; a "
                    "checkpoint: the architecture from config.json, the tokenizer and chat template, EOS and stop "
                    "ids from generation_config.json, KV blocks filling --kv-cache-gb), with golden cases from "
                    "example runs, then loads and golden-checks it as a worker would.")
    imported.add_argument("source", help="the model file (.onnx, or TorchScript .pt/.pth/.ts/.torchscript), or a "
                                         "Hugging Face checkpoint directory (config.json, *.safetensors, "
                                         "tokenizer.json)")
    imported.add_argument("--name", required=True, help="the model's name in the repository")
    imported.add_argument("--version", required=True, help="the version to create (never overwritten)")
    imported.add_argument("--repository", default=os.environ.get("INFERMESH_MODEL_REPOSITORY", "model_repo"),
                          help="the model repository (default: $INFERMESH_MODEL_REPOSITORY or %(default)s)")
    imported.add_argument("--input", action="append", default=[], metavar="NAME:DATATYPE:DIMS",
                          help="an input, in forward()'s order (TorchScript needs each; for ONNX it overrides the "
                               "graph's), e.g. x:FP32:-1,3,32,32 (batch first as -1, -1: any size)")
    imported.add_argument("--output", action="append", default=[], metavar="NAME",
                          help="TorchScript: the name of each returned tensor, in order (default output0, ...)")
    imported.add_argument("--max-batch-size", type=int, default=8,
                          help="most rows one batch runs (default: %(default)s)")
    imported.add_argument("--preferred-batch-sizes", default="", metavar="N,N",
                          help="batch sizes the scheduler sends without waiting for more (Triton's)")
    imported.add_argument("--image-input", default="", metavar="NAME",
                          help="preprocess this FP32 [-1,C,H,W] input with the image kernel: clients send "
                               "uint8 HWC images of any size, resized and normalized by the worker")
    imported.add_argument("--image-mean", default="", metavar="M[,M,M]", help="per channel, 0..1 pixel units")
    imported.add_argument("--image-std", default="", metavar="S[,S,S]", help="per channel, > 0")
    imported.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                          help="height x width limit of an image input (default: %(default)s)")
    imported.add_argument("--golden-atol", type=float, default=1e-4,
                          help="absolute tolerance of the golden check at load (default: %(default)s)")
    imported.add_argument("--golden-rtol", type=float, default=1e-3,
                          help="relative tolerance of the golden check at load (default: %(default)s)")
    llm = imported.add_argument_group("Hugging Face checkpoints")
    llm.add_argument("--kv-cache-gb", type=float, default=1.0,
                     help="memory for the KV cache, GiB: the KV blocks a worker allocates fill it (default: "
                          "%(default)s)")
    llm.add_argument("--max-seq-len", type=int, default=0,
                     help="longest prompt + output, tokens (0: config.json's max_position_embeddings, capped by what "
                          "the KV cache holds)")
    llm.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="",
                     help="the format the model writes tool calls in, recorded in the manifest (default: told from "
                          "the chat template when it serves)")
    llm.add_argument("--generation-config", choices=("auto", "none"), default="auto",
                     help="auto: record generation_config.json's recommended sampling (temperature, top_p, top_k, "
                          "min_p, repetition_penalty), which OpenAI requests that leave a field out get, as vLLM's "
                          "--generation-config auto; none: record none (default: %(default)s)")
    llm.add_argument("--task", choices=("auto", "embed", "generate"), default="auto",
                     help="embed: an embedding model, served on /v1/embeddings only (pooling and normalization from "
                          "the sentence-transformers files, else last token, normalized); generate: a generator of "
                          "text; auto: embed for a sentence-transformers directory (modules.json) or a base model "
                          "without an LM head, else generate (default: %(default)s)")
    llm.add_argument("--reasoning-parser", choices=(*REASONING_PARSERS, NO_REASONING_PARSER), default=None,
                     help="how the model sets its reasoning apart (<think>...</think>), recorded in the manifest; "
                          f"{NO_REASONING_PARSER}: not split (default: {QWEN3} for a chat template that writes "
                          "<think> and </think>, else none)")
    llm.add_argument("--lora", action="append", default=[], metavar="NAME=ADAPTER_DIR",
                     help="a PEFT LoRA adapter of the model (adapter_config.json, adapter_model.safetensors), pinned "
                          "beside it by sha256 and served as model NAME (repeat for more; docs/models.md, "
                          "\"LoRA adapters\")")


def _lora_flags(flags: list[str]) -> tuple[tuple[str, str], ...]:
    """--lora NAME=ADAPTER_DIR, each."""
    pairs = []
    for flag in flags:
        name, sep, directory = flag.partition("=")
        if not sep or not name or not directory:
            raise UsageError(f"--lora {flag!r}: expected NAME=ADAPTER_DIR")
        pairs.append((name, directory))
    return tuple(pairs)


def _reasoning_parser(flag: str | None) -> str | None:
    """--reasoning-parser as ImportOptions takes it: None (absent) tells it from the template."""
    return "" if flag == NO_REASONING_PARSER else flag


def source_kind(source: Path) -> str:
    """Which importer reads SOURCE; UsageError naming what is accepted for anything else."""
    if source.is_file() and source.suffix.lower() in TENSOR_SUFFIXES:
        return TENSOR
    if source.is_dir() and (source / "config.json").is_file():
        return HF
    if not source.exists():
        raise UsageError(f"{source}: no such file or directory")
    raise UsageError(f"{source}: not a model this command imports (a TorchScript or ONNX file: "
                     f"{', '.join(TENSOR_SUFFIXES)}; or a Hugging Face checkpoint directory holding config.json)")


def run_models(args: argparse.Namespace) -> int:
    source = Path(args.source)
    return IMPORTERS[source_kind(source)](source, args)


def _numbers(text: str, flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected numbers separated by commas") from None


def _import_tensor(source: Path, args: argparse.Namespace) -> int:
    from services.worker.repository.errors import ModelRepositoryError
    from services.worker.repository.golden import run_golden_check
    from services.worker.repository.loader import load_model
    from services.worker.repository.tensor_import import (
        ImageFlags,
        ImportRequest,
        import_tensor_model,
        parse_input_flag,
    )

    image = None
    if args.image_input:
        if not args.image_mean or not args.image_std:
            raise UsageError("--image-input needs --image-mean and --image-std (one number per channel)")
        mean, std = _numbers(args.image_mean, "--image-mean"), _numbers(args.image_std, "--image-std")
        if len(mean) != len(std) or len(mean) not in (1, 3) or min(std) <= 0:
            raise UsageError("--image-mean and --image-std need 1 or 3 entries each, std > 0")
        image = ImageFlags(args.image_input, mean, std, args.max_image_pixels)
    try:
        preferred = tuple(int(x) for x in args.preferred_batch_sizes.split(",")) if args.preferred_batch_sizes else ()
    except ValueError:
        raise UsageError(f"--preferred-batch-sizes {args.preferred_batch_sizes!r}: integers separated by commas") from None
    try:
        request = ImportRequest(
            source=source, name=args.name, version=args.version, repository=Path(args.repository),
            inputs=tuple(parse_input_flag(flag) for flag in args.input), output_names=tuple(args.output),
            max_batch_size=args.max_batch_size, preferred_batch_sizes=preferred, image=image,
            golden_atol=args.golden_atol, golden_rtol=args.golden_rtol)
        directory = import_tensor_model(request)
    except ModelRepositoryError as exc:
        raise UsageError(str(exc)) from None
    try:
        run_golden_check(load_model(request.repository, args.name, args.version))
    except ModelRepositoryError as exc:  # as a worker would refuse it: nothing half-made stays behind
        shutil.rmtree(directory)
        raise UsageError(f"the imported version does not load as a worker loads it, so it was removed: {exc}") from None
    print(f"imported {source.name} as {args.name}/{args.version} in {directory}")
    return 0


def _import_hf(source: Path, args: argparse.Namespace) -> int:
    from services.common.errors import InfermeshError
    from services.worker.repository.errors import ModelRepositoryError
    from services.worker.repository.golden import run_golden_check
    from services.worker.repository.hf_import import (
        ImportOptions,
        ImportRefused,
        chat_template_text,
        import_checkpoint,
    )
    from services.worker.repository.loader import load_model
    from services.worker.repository.store import version_dir

    if not args.kv_cache_gb > 0 or args.max_seq_len < 0:
        raise UsageError(f"--kv-cache-gb must be > 0 and --max-seq-len >= 0, got {args.kv_cache_gb} and "
                         f"{args.max_seq_len}")
    options = ImportOptions(name=args.name, version=args.version, kv_cache_bytes=int(args.kv_cache_gb * 2**30),
                            max_seq_len=args.max_seq_len or None, tool_call_parser=args.tool_call_parser,
                            reasoning_parser=_reasoning_parser(args.reasoning_parser),
                            generation_config=args.generation_config == "auto", task=args.task,
                            lora_adapters=_lora_flags(args.lora))
    try:
        manifest = import_checkpoint(source, args.repository, options)
    except (ImportRefused, InfermeshError) as exc:  # InfermeshError: a name or version the repository refuses
        raise UsageError(str(exc)) from None
    try:
        run_golden_check(load_model(args.repository, args.name, args.version))
    except ModelRepositoryError as exc:  # as a worker would refuse it: nothing half-made stays behind
        shutil.rmtree(version_dir(args.repository, args.name, args.version))
        raise UsageError(f"the imported version does not load as a worker loads it, so it was removed: {exc}") from None
    spec, envelope = manifest.generator, manifest.envelope
    assert spec is not None
    num_golden = len(spec.golden) if spec.embedding is None else len(spec.embedding.golden)
    print(f"imported {source} as {args.name}/{args.version} in {args.repository}: {spec.max_seq_len}-token "
          f"context, {envelope.num_kv_blocks} KV blocks of {envelope.block_size} tokens, {num_golden} "
          "golden prompts")
    if spec.embedding is not None:
        e = spec.embedding
        print(f"an embedding model (/v1/embeddings only): {e.dimensions} dimensions, {e.pooling.value} pooling, "
              f"{'normalized' if e.normalize else 'not normalized'}{', Matryoshka' if e.matryoshka else ''}")
    print(_recorded(spec, parser_for_template(chat_template_text(source))))
    quantized = _quantized(source)
    if quantized:
        print(quantized)
    if spec.lora_adapters:
        print(f"LoRA adapters, each served as a model of its own over {args.name}: "
              f"{', '.join(pin.name for pin in spec.lora_adapters)}")
    return 0


def _quantized(source: Path) -> str:
    """For a quantized checkpoint, what it is and what serving it costs (the worker dequantizes it at
    load); "" for an unquantized one."""
    from services.worker.models.llama_weights import read_config
    from services.worker.models.quantization_config import describe
    from services.worker.repository.hf_import import weight_bytes

    config = read_config(source)
    if config.quantization is None:
        return ""
    return (f"weights: {describe(config.quantization)}, dequantized at load: the worker holds the unquantized "
            f"model, {weight_bytes(config) / 2**30:.2f} GiB in float32 ({weight_bytes(config, 2) / 2**30:.2f} GiB "
            "in bfloat16)")


def _recorded(spec: GeneratorSpec, template_tool_parser: str) -> str:
    """What the import told from the checkpoint, on one line, so a user sees what will be served;
    `template_tool_parser`: the one the chat template implies (the scheduler tells it the same way)."""
    tokenizer = spec.tokenizer
    tool_parser = (getattr(tokenizer, "tool_call_parser", "") or template_tool_parser
                   or "none (auto tool choice returns content)")
    reasoning_parser = getattr(tokenizer, "reasoning_parser", "") or "none"
    sampling = ", ".join(f"{name} {value:g}" for name, value in spec.sampling_defaults.to_json().items()) or "none"
    architecture = getattr(spec.architecture, "architecture", "tinylm")
    return (f"{architecture}; tool-call parser: {tool_parser}; reasoning parser: {reasoning_parser}; "
            f"recommended sampling: {sampling}")


# Each kind of SOURCE (source_kind) and the importer that reads it.
IMPORTERS: dict[str, Callable[[Path, argparse.Namespace], int]] = {TENSOR: _import_tensor, HF: _import_hf}
