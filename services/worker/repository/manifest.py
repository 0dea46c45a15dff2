"""The manifest schema: one frozen dataclass per block, each with its own strict validator.

Manifest (JSON), `format_version` 1 — see docs/models.md:

    name, version, kind ("classifier" | "generator" | "tensor"), format_version
    weights:   {file, sha256} (torch) | {format: "safetensors", files, index}   weights_spec.py
    envelope:  {max_batch_size, max_num_seqs, max_num_batched_tokens, num_kv_blocks, block_size, memory_bytes}
    <kind>:    the block named after the kind, and no other kind's block
      classifier: {inputs, labels, architecture, golden}          classifier_spec.py
      generator:  {inputs, tokenizer, architecture, golden}        generator_spec.py, tokenizer_spec.py,
                  (architecture {format: "hf", config, ...}: a Hugging Face config.json, hf_architecture.py)
      tensor:     {format, inputs, outputs, preferred_batch_sizes, golden, golden_tolerance}   tensor_spec.py
    quality:   {str: number}   informational figures from the build (accuracy, loss, seconds)
    build:     {str: str}      informational provenance (recipe digest, tool)

A new kind is a ModelKind member, its spec dataclass (`from_json(fields, envelope)`, `to_json()`,
`ENVELOPE_NEEDS`) registered in KINDS, and the Manifest field named after it; the loader
(loader.py), the golden check (golden.py) and the worker's model_runtime.py each register what
serving it takes.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self

from services.worker.repository.classifier_spec import ClassifierSpec
from services.worker.repository.envelope import Envelope
from services.worker.repository.errors import InvalidManifest
from services.worker.repository.generator_spec import GeneratorSpec
from services.worker.repository.json_fields import JsonFields, one_of
from services.worker.repository.tensor_spec import TensorSpec
from services.worker.repository.weights_spec import Weights, parse_weights

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")  # model names and versions, also as directory names


class ModelKind(enum.Enum):
    CLASSIFIER = "classifier"
    GENERATOR = "generator"
    TENSOR = "tensor"  # a TorchScript or ONNX file brought as it is


class KindSpec(Protocol):
    """What each kind's block offers the manifest."""

    ENVELOPE_NEEDS: ClassVar[frozenset[str]]  # envelope fields this kind uses: they must be >= 1

    @classmethod
    def from_json(cls, fields: JsonFields, envelope: Envelope, /) -> Self: ...

    def to_json(self) -> dict[str, Any]: ...


# Each kind's block, keyed by the kind string; the JSON key and the Manifest field carry the same name.
KINDS: dict[str, type[KindSpec]] = {
    ModelKind.CLASSIFIER.value: ClassifierSpec,
    ModelKind.GENERATOR.value: GeneratorSpec,
    ModelKind.TENSOR.value: TensorSpec,
}


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    kind: ModelKind
    weights: Weights
    envelope: Envelope
    classifier: ClassifierSpec | None = None
    generator: GeneratorSpec | None = None
    tensor: TensorSpec | None = None
    quality: dict[str, float] = field(default_factory=dict)
    build: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        present = {kind for kind in KINDS if getattr(self, kind) is not None}
        if present != {self.kind.value}:
            raise ValueError(f"a {self.kind.value} manifest holds the {self.kind.value} block alone, "
                             f"got {sorted(present)}")

    @property
    def spec(self) -> KindSpec:
        """The block of this manifest's kind."""
        spec: KindSpec = getattr(self, self.kind.value)
        return spec


def manifest_to_dict(manifest: Manifest) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "name": manifest.name,
        "version": manifest.version,
        "kind": manifest.kind.value,
        "weights": manifest.weights.to_json(),
        "envelope": manifest.envelope.to_json(),
        manifest.kind.value: manifest.spec.to_json(),
        "quality": dict(manifest.quality),
        "build": dict(manifest.build),
    }


def parse_manifest(data: Any, *, source: str) -> Manifest:
    """A validated Manifest, or InvalidManifest naming the file and the offending field."""
    try:
        return _parse(JsonFields(data, source, ""))
    except ValueError as exc:  # raised by the config dataclasses' own checks
        raise InvalidManifest(f"{source}: {exc}") from None


def _parse(o: JsonFields) -> Manifest:
    o.allow_only("format_version", "name", "version", "kind", "weights", "envelope", *KINDS, "quality", "build")
    if o.raw("format_version") != FORMAT_VERSION:
        raise o.fail("format_version", f"must be {FORMAT_VERSION}, got {o.raw('format_version')!r}")
    name = o.text("name", NAME_RE)
    version = o.text("version", NAME_RE)
    if version == "latest":
        raise o.fail("version", "must be an exact version; 'latest' is not allowed")
    kind = _kind(o)
    for other in KINDS:
        if other != kind.value and other in o.data:
            raise o.fail(other, f"must be absent for a {kind.value}")
    weights = parse_weights(o.obj("weights"))
    schema = KINDS[kind.value]
    envelope = Envelope.from_json(o.obj("envelope"), schema.ENVELOPE_NEEDS)
    spec: dict[str, Any] = {kind.value: schema.from_json(o.obj(kind.value), envelope)}  # the kind's own field
    quality = {}
    if "quality" in o.data:
        q = o.obj("quality")
        quality = {k: q.number(k) for k in q.data}
    build = {}
    if "build" in o.data:
        b = o.obj("build")
        build = {k: b.text(k) for k in b.data}
    return Manifest(name, version, kind, weights, envelope, quality=quality, build=build, **spec)


def _kind(o: JsonFields) -> ModelKind:
    text = o.text("kind")
    if text not in KINDS:
        raise o.fail("kind", f"must be {one_of(KINDS)}, got {text!r}")
    return ModelKind(text)
