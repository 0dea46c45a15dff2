"""Loading a model version: its manifest, the weights' sha256, then the serving runtime its kind builds.

The sha256 is checked before the weights are read, so a modified version is refused before any
of its bytes are deserialized. Each kind registers in RUNTIME_BUILDERS how its spec and a
state_dict become a runtime; a kind whose file is a whole model in its own format (tensor:
TorchScript, ONNX) registers in FILE_RUNTIME_BUILDERS instead, and its file is never torch.load'ed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.worker.models.classifier import Classifier, Cnn
from services.worker.models.generator import Generator
from services.worker.models.tensor_model import TensorModel, open_tensor_model
from services.worker.models.transformer import DecoderLM
from services.worker.repository.classifier_spec import ClassifierSpec
from services.worker.repository.errors import IncompatibleWeights
from services.worker.repository.generator_spec import GeneratorSpec
from services.worker.repository.manifest import Manifest, ModelKind
from services.worker.repository.store import load_manifest, verified_file, version_dir
from services.worker.repository.tensor_spec import TensorSpec


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


def load_model(root: str | Path, name: str, version: str, device: str = "cpu", num_threads: int = 1) -> LoadedModel:
    """Parses the manifest, verifies the weights' sha256, and builds the serving runtime (`num_threads`:
    the worker's CPU allocation, for runtimes that size their own pools)."""
    manifest = load_manifest(root, name, version)
    directory = version_dir(root, name, version)
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


def _load_state(module: torch.nn.Module, state: Any, weights_path: Path) -> None:
    if not isinstance(state, dict):
        raise IncompatibleWeights(f"{weights_path} holds a {type(state).__name__}, not a state_dict")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise IncompatibleWeights(f"{weights_path} does not fit the manifest's architecture: {exc}") from None
