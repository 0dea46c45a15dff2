"""Loading a model version: its manifest, the weights' sha256, then the serving runtime its kind builds.

A torch state_dict's sha256 is checked before the file is read, so a modified version is refused
before any of its bytes are unpickled. Safetensors weights (no pickle: a JSON header, then raw
bytes) are hashed in the one pass that reads them into the model, and the model is dropped unless
every file matches: the bytes compared are the bytes served, and a load reads them once. Each kind registers in RUNTIME_BUILDERS how its spec and a
state_dict become a runtime; a kind whose file is a whole model in its own format (tensor:
TorchScript, ONNX) registers in FILE_RUNTIME_BUILDERS instead, and its file is never torch.load'ed;
a weights format that is not one torch state_dict (safetensors: a Hugging Face checkpoint)
registers in CHECKPOINT_BUILDERS how its pinned files become one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker.models.classifier import Classifier, Cnn
from services.worker.models.generator import Generator
from services.worker.models.llama_config import CheckpointError, LlamaFamilyConfig
from services.worker.models.llama_weights import load_llama_family
from services.worker.models.tensor_model import TensorModel, open_tensor_model
from services.worker.models.transformer import DecoderLM, TransformerConfig
from services.worker.repository.classifier_spec import ClassifierSpec
from services.worker.repository.errors import IncompatibleWeights
from services.worker.repository.generator_spec import GeneratorSpec
from services.worker.repository.hf_architecture import HFArchitecture
from services.worker.repository.lora_pins import LoraPin
from services.worker.repository.manifest import Manifest, ModelKind
from services.worker.repository.store import check_sha256, load_manifest, verified_file, version_dir
from services.worker.repository.tensor_spec import TensorSpec
from services.worker.repository.weights_spec import SAFETENSORS, SafetensorsWeights

# What a worker's --compute-dtype may name: the dtype weights are cast to and matmuls run in
# (attention and the KV cache stay float32 whatever it is; models/llama_family.py).
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoadedModel:
    manifest: Manifest
    path: Path  # the version directory
    runtime: Classifier | Generator | TensorModel

    @property
    def device(self) -> str:
        """Where the weights live, as torch names it: 'cpu', 'cuda:0', …"""
        if isinstance(self.runtime, Generator):
            return str(self.runtime.device)
        if not isinstance(self.runtime, Classifier):
            return self.runtime.device
        return str(next(self.runtime.net.parameters()).device)

    @property
    def classifier(self) -> Classifier:
        if not isinstance(self.runtime, Classifier):
            raise ValueError(f"{self.manifest.name}/{self.manifest.version} is a {self.manifest.kind.value}")
        return self.runtime

    @property
    def tensor(self) -> TensorModel:
        if isinstance(self.runtime, Classifier | Generator):
            raise ValueError(f"{self.manifest.name}/{self.manifest.version} is a {self.manifest.kind.value}")
        return self.runtime

    @property
    def generator(self) -> Generator:
        if not isinstance(self.runtime, Generator):
            raise ValueError(f"{self.manifest.name}/{self.manifest.version} is a {self.manifest.kind.value}")
        return self.runtime


def load_model(root: str | Path, name: str, version: str, device: str = "cpu", num_threads: int = 1, *,
               compute_dtype: str = "float32") -> LoadedModel:
    """Parses the manifest, verifies the weights' sha256, and builds the serving runtime (`num_threads`:
    the worker's CPU allocation, for runtimes that size their own pools; `compute_dtype`: COMPUTE_DTYPES)."""
    manifest = load_manifest(root, name, version)
    directory = version_dir(root, name, version)
    if isinstance(manifest.weights, SafetensorsWeights):
        checkpoint = CHECKPOINT_BUILDERS[SAFETENSORS](manifest, directory, device, COMPUTE_DTYPES[compute_dtype])
        return LoadedModel(manifest, directory, checkpoint)
    weights_path = verified_file(directory, manifest.weights.file, manifest.weights.sha256, "weights")
    if manifest.kind in FILE_RUNTIME_BUILDERS:
        runtime = FILE_RUNTIME_BUILDERS[manifest.kind](manifest.spec, weights_path, device, num_threads)
        return LoadedModel(manifest, directory, runtime)
    state = torch.load(weights_path, map_location=device, weights_only=True)
    build = RUNTIME_BUILDERS[manifest.kind]
    return LoadedModel(manifest, directory, build(manifest.spec, state, weights_path, device))


def _classifier(spec: Any, state: Any, weights_path: Path, device: str) -> Classifier:
    assert isinstance(spec, ClassifierSpec)  # RUNTIME_BUILDERS is keyed by the manifest's kind
    net = Cnn(spec.architecture)
    _load_state(net, state, weights_path)
    return Classifier(net.to(device), labels=spec.labels, mean=spec.inputs.mean, std=spec.inputs.std,
                      max_image_pixels=spec.inputs.max_image_pixels)


def _generator(spec: Any, state: Any, weights_path: Path, device: str) -> Generator:
    assert isinstance(spec, GeneratorSpec)
    if not isinstance(spec.architecture, TransformerConfig):
        raise IncompatibleWeights(f"{weights_path}: a torch state_dict serves tinylm's architecture, not "
                                  f"{spec.architecture.architecture} (whose weights are safetensors)")
    lm = DecoderLM(spec.architecture)
    _load_state(lm, state, weights_path)
    bos = spec.tokenizer.bos_token_id
    return Generator(lm.to(device), max_seq_len=spec.max_seq_len, eos_token_id=spec.tokenizer.eos_token_id,
                     bos_token_id=None if bos < 0 else bos)


# (the kind's spec, the state_dict, its file for messages, the torch device) -> the serving runtime
RUNTIME_BUILDERS: dict[ModelKind, Callable[[Any, Any, Path, str], Classifier | Generator]] = {
    ModelKind.CLASSIFIER: _classifier,
    ModelKind.GENERATOR: _generator,
}


def _tensor(spec: Any, model_path: Path, device: str, num_threads: int) -> TensorModel:
    assert isinstance(spec, TensorSpec)
    return open_tensor_model(spec, model_path, device, num_threads)


# (the kind's spec, its model file, the torch device, the worker's threads) -> the serving runtime
FILE_RUNTIME_BUILDERS: dict[ModelKind, Callable[[Any, Path, str, int], TensorModel]] = {
    ModelKind.TENSOR: _tensor,
}


def _hf_generator(manifest: Manifest, directory: Path, device: str, dtype: torch.dtype) -> Generator:
    """A Hugging Face checkpoint: config.json (and the shards' index) verified, then parsed, the safetensors
    headers checked against it before any tensor is read, and every weight file hashed as it is read into
    the model (models/llama_weights.py), which is served only if all match.
    Refusals name the file and the field (`architectures[0]`, a tensor's name) and what is supported."""
    spec, weights = manifest.generator, manifest.weights
    if spec is None or not isinstance(spec.architecture, HFArchitecture):
        raise IncompatibleWeights(f"{directory}: safetensors weights serve a generator whose architecture "
                                  "has format 'hf' (a config.json)")
    assert isinstance(weights, SafetensorsWeights)  # CHECKPOINT_BUILDERS is keyed by the weights' format
    architecture = spec.architecture
    small = (architecture.config, *(() if weights.index is None else (weights.index,)))
    for pinned in small:
        verified_file(directory, pinned.file, pinned.sha256, "config" if pinned is architecture.config else "weights")
    digests: dict[Path, str] = {}
    try:
        lm = load_llama_family(directory, dtype=dtype, device=device, max_seq_len=spec.max_seq_len, sha256=digests,
                               embedding_only=spec.embedding is not None)
    except CheckpointError as exc:
        for pinned in weights.files:  # a modified file is refused as modified, not by what broke in it
            verified_file(directory, pinned.file, pinned.sha256, "weights")
        raise IncompatibleWeights(str(exc)) from None
    for pinned in weights.files:  # hashed as they were read; a file the model did not need, now
        path = directory / pinned.file
        if path in digests:
            check_sha256(path, digests[path], pinned.sha256, "weights")
        else:
            verified_file(directory, pinned.file, pinned.sha256, "weights")
    config = lm.config
    if (config.architecture, config.vocab_size) != (architecture.architecture, architecture.vocab_size):
        raise IncompatibleWeights(
            f"{directory / architecture.config.file}: architectures[0] {config.architecture!r} and vocab_size "
            f"{config.vocab_size}, but the manifest says {architecture.architecture!r} and {architecture.vocab_size}")
    bos = spec.tokenizer.bos_token_id
    generator = Generator(lm, max_seq_len=spec.max_seq_len, eos_token_id=spec.tokenizer.eos_token_id,
                          bos_token_id=None if bos < 0 else bos)
    for pin in spec.lora_adapters:
        _add_pinned_adapter(generator, pin, directory, dtype)
    return generator


def _add_pinned_adapter(generator: Generator, pin: LoraPin, directory: Path, dtype: torch.dtype) -> None:
    """A LoRA adapter of the version (lora_pins.py): both files verified before either is read."""
    from services.worker.models.lora import load_lora_adapter

    for pinned in (pin.config, pin.weights):
        verified_file(directory, pinned.file, pinned.sha256, f"LoRA adapter {pin.name!r}")
    assert isinstance(generator.config, LlamaFamilyConfig)  # an 'hf' architecture (GeneratorSpec checks)
    try:
        generator.add_lora(load_lora_adapter(pin.name, directory, generator.config, dtype=dtype,
                                             device=generator.device, config_file=pin.config.file,
                                             weights_file=pin.weights.file))
    except CheckpointError as exc:
        raise IncompatibleWeights(f"LoRA adapter {pin.name!r}: {exc}") from None


# weights.format -> (manifest, version directory, torch device, compute dtype) -> the serving runtime
CHECKPOINT_BUILDERS: dict[str, Callable[[Manifest, Path, str, torch.dtype], Generator]] = {
    SAFETENSORS: _hf_generator,
}


def _load_state(module: torch.nn.Module, state: Any, weights_path: Path) -> None:
    if not isinstance(state, dict):
        raise IncompatibleWeights(f"{weights_path} holds a {type(state).__name__}, not a state_dict")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise IncompatibleWeights(f"{weights_path} does not fit the manifest's architecture: {exc}") from None
