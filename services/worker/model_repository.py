"""The model repository: `<root>/<name>/<version>/manifest.json` plus weights.

A version directory is immutable once written: the manifest pins the weights'
sha256, which `load_model` checks before unpickling anything, and there is no
`latest` alias — callers name the exact version. `run_golden_check` runs the
fixed inputs recorded in the manifest through the serving path (preprocessing
kernel for the classifier, paged KV path for the generator) and compares with
the outputs recorded when the model was built.

Manifest schema (JSON), `format_version` 1 — see docs/models.md:

    name, version, kind ("classifier" | "generator"), format_version
    weights:   {file, sha256}
    envelope:  {max_batch_size, max_num_seqs, max_num_batched_tokens, num_kv_blocks, block_size, memory_bytes}
    classifier (kind classifier only):
      inputs:       {input_height, input_width, channels, max_image_pixels, mean[], std[]}  (mean/std in 0..1 units)
      labels:       [str]                      output order
      architecture: CnnConfig fields
      golden:       [{height, width, channels, pixels_b64, expected_top1}]   raw uint8 HWC
    generator (kind generator only):
      inputs:       {max_seq_len}
      tokenizer:    {kind: "bytes", vocab_size, eos_token_id, bos_token_id (-1: none)}
      architecture: TransformerConfig fields
      golden:       [{prompt_ids[], expected_ids[]}]                        greedy continuation
    quality:   {str: number}   informational figures from the build (accuracy, loss, seconds)
    build:     {str: str}      informational provenance (recipe digest, tool)
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.common.errors import InfermeshError, NotFound
from services.worker.models.classifier import Classifier, Cnn, CnnConfig
from services.worker.models.generator import Generator
from services.worker.models.transformer import DecoderLM, TransformerConfig

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ModelRepositoryError(InfermeshError):
    """A model version exists but cannot be served as it is on disk."""


class InvalidManifest(ModelRepositoryError):
    pass


class WeightsChecksumMismatch(ModelRepositoryError):
    pass


class IncompatibleWeights(ModelRepositoryError):
    pass


class GoldenCheckFailed(ModelRepositoryError):
    pass


class ModelKind(enum.Enum):
    CLASSIFIER = "classifier"
    GENERATOR = "generator"


@dataclass(frozen=True)
class WeightsRef:
    file: str  # a file name inside the version directory
    sha256: str  # lowercase hex digest of the file's bytes


@dataclass(frozen=True)
class Envelope:
    """What the worker declares at attach; fields that do not apply to the kind are 0."""

    max_batch_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    block_size: int  # tokens per KV block
    memory_bytes: int  # weights + KV cache (+ activations estimate)


@dataclass(frozen=True)
class ClassifierInputs:
    input_height: int
    input_width: int
    channels: int  # 1 or 3; images are converted to this before preprocessing
    max_image_pixels: int  # height * width limit checked before decoding
    mean: tuple[float, ...]  # per channel, 0..1 pixel units
    std: tuple[float, ...]


@dataclass(frozen=True)
class GoldenImage:
    height: int
    width: int
    channels: int
    pixels: bytes  # raw uint8 HWC
    expected_top1: int

    def array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, dtype=np.uint8).reshape(self.height, self.width, self.channels)


@dataclass(frozen=True)
class ClassifierSpec:
    inputs: ClassifierInputs
    labels: tuple[str, ...]
    architecture: CnnConfig
    golden: tuple[GoldenImage, ...]


@dataclass(frozen=True)
class TokenizerSpec:
    kind: str  # "bytes": id = UTF-8 byte value, specials above 255
    vocab_size: int
    eos_token_id: int
    bos_token_id: int  # -1: none


@dataclass(frozen=True)
class GoldenGeneration:
    prompt_ids: tuple[int, ...]
    expected_ids: tuple[int, ...]  # greedy continuation


@dataclass(frozen=True)
class GeneratorSpec:
    max_seq_len: int  # prompt + generated tokens
    tokenizer: TokenizerSpec
    architecture: TransformerConfig
    golden: tuple[GoldenGeneration, ...]


@dataclass(frozen=True)
class Manifest:
    name: str
    version: str
    kind: ModelKind
    weights: WeightsRef
    envelope: Envelope
    classifier: ClassifierSpec | None = None
    generator: GeneratorSpec | None = None
    quality: dict[str, float] = field(default_factory=dict)
    build: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str


@dataclass(frozen=True)
class LoadedModel:
    manifest: Manifest
    path: Path  # the version directory
    runtime: Classifier | Generator

    @property
    def device(self) -> str:
        """Where the weights live, as torch names it: 'cpu', 'cuda:0', …"""
        if isinstance(self.runtime, Generator):
            return str(self.runtime.device)
        return str(next(self.runtime.net.parameters()).device)

    @property
    def classifier(self) -> Classifier:
        if not isinstance(self.runtime, Classifier):
            raise ValueError(f"{self.manifest.name}/{self.manifest.version} is a {self.manifest.kind.value}")
        return self.runtime

    @property
    def generator(self) -> Generator:
        if not isinstance(self.runtime, Generator):
            raise ValueError(f"{self.manifest.name}/{self.manifest.version} is a {self.manifest.kind.value}")
        return self.runtime


# ---------------------------------------------------------------------------
# Listing and loading
# ---------------------------------------------------------------------------


def list_models(root: str | Path) -> list[ModelVersion]:
    """Every `<name>/<version>` under root that has a manifest, sorted (numeric versions numerically)."""
    root = Path(root)
    if not root.is_dir():
        raise NotFound(f"model repository {root} does not exist")
    found = [
        ModelVersion(manifest.parent.parent.name, manifest.parent.name)
        for manifest in root.glob(f"*/*/{MANIFEST_FILE}")
        if _NAME_RE.match(manifest.parent.parent.name) and _NAME_RE.match(manifest.parent.name)
    ]
    return sorted(found, key=lambda m: (m.name, _version_key(m.version)))


def version_dir(root: str | Path, name: str, version: str) -> Path:
    for what, value in (("name", name), ("version", version)):
        if not _NAME_RE.match(value):
            raise NotFound(f"model {what} {value!r} is not a valid repository {what}")
    if version == "latest":
        raise NotFound("there is no 'latest' version; name an exact version")
    return Path(root) / name / version


def load_manifest(root: str | Path, name: str, version: str) -> Manifest:
    path = version_dir(root, name, version) / MANIFEST_FILE
    if not path.is_file():
        raise NotFound(f"model {name}/{version} not found in {root} (no {path})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidManifest(f"{path}: not valid JSON: {exc}") from None
    manifest = parse_manifest(data, source=str(path))
    if (manifest.name, manifest.version) != (name, version):
        raise InvalidManifest(
            f"{path}: manifest says {manifest.name}/{manifest.version} but lives in {name}/{version}"
        )
    return manifest


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_model(root: str | Path, name: str, version: str, device: str = "cpu") -> LoadedModel:
    """Parses the manifest, verifies the weights' sha256, and builds the serving runtime."""
    manifest = load_manifest(root, name, version)
    directory = version_dir(root, name, version)
    weights_path = directory / manifest.weights.file
    if not weights_path.is_file():
        raise InvalidManifest(f"{directory / MANIFEST_FILE}: weights file {weights_path} is missing")
    actual = sha256_of(weights_path)
    if actual != manifest.weights.sha256:
        raise WeightsChecksumMismatch(
            f"weights file {weights_path} has sha256 {actual} but the manifest expects "
            f"{manifest.weights.sha256}; refusing to load a modified model version"
        )
    state = torch.load(weights_path, map_location=device, weights_only=True)
    return LoadedModel(manifest, directory, _build_runtime(manifest, state, weights_path, device))


def _build_runtime(manifest: Manifest, state: Any, weights_path: Path, device: str) -> Classifier | Generator:
    if manifest.classifier is not None:
        classifier = manifest.classifier
        net = Cnn(classifier.architecture)
        _load_state(net, state, weights_path)
        return Classifier(
            net.to(device), labels=classifier.labels, mean=classifier.inputs.mean, std=classifier.inputs.std,
            max_image_pixels=classifier.inputs.max_image_pixels,
        )
    assert manifest.generator is not None  # parse_manifest guarantees one spec per kind
    generator = manifest.generator
    lm = DecoderLM(generator.architecture)
    _load_state(lm, state, weights_path)
    bos = generator.tokenizer.bos_token_id
    return Generator(
        lm.to(device), max_seq_len=generator.max_seq_len, eos_token_id=generator.tokenizer.eos_token_id,
        bos_token_id=None if bos < 0 else bos,
    )


def _load_state(module: torch.nn.Module, state: Any, weights_path: Path) -> None:
    if not isinstance(state, dict):
        raise IncompatibleWeights(f"{weights_path} holds a {type(state).__name__}, not a state_dict")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise IncompatibleWeights(f"{weights_path} does not fit the manifest's architecture: {exc}") from None


# ---------------------------------------------------------------------------
# Golden check
# ---------------------------------------------------------------------------


def run_golden_check(model: LoadedModel) -> None:
    """Runs the manifest's fixed inputs through the serving path; GoldenCheckFailed on any mismatch."""
    m = model.manifest
    where = f"{m.name}/{m.version}"
    if m.classifier is not None:
        images = m.classifier.golden
        probs = model.classifier.classify([g.array() for g in images])
        got = [int(i) for i in probs.argmax(axis=1)]
        want = [g.expected_top1 for g in images]
        if got != want:
            raise GoldenCheckFailed(f"{where}: golden images classified as {got}, expected {want}")
        return
    assert m.generator is not None
    block_size = m.envelope.block_size
    for i, golden in enumerate(m.generator.golden):
        got = model.generator.greedy_paged(
            golden.prompt_ids, len(golden.expected_ids), block_size=block_size,
            prefill_chunk=max(1, m.envelope.max_num_batched_tokens // 2),
        )
        if tuple(got) != golden.expected_ids:
            raise GoldenCheckFailed(
                f"{where}: golden prompt {i} continued as {got}, expected {list(golden.expected_ids)}"
            )


# ---------------------------------------------------------------------------
# Manifest (de)serialization
# ---------------------------------------------------------------------------


def manifest_to_dict(manifest: Manifest) -> dict[str, Any]:
    data: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "name": manifest.name,
        "version": manifest.version,
        "kind": manifest.kind.value,
        "weights": asdict(manifest.weights),
        "envelope": asdict(manifest.envelope),
    }
    if manifest.classifier is not None:
        c = manifest.classifier
        data["classifier"] = {
            "inputs": {**asdict(c.inputs), "mean": list(c.inputs.mean), "std": list(c.inputs.std)},
            "labels": list(c.labels),
            "architecture": {**asdict(c.architecture), "conv_channels": list(c.architecture.conv_channels)},
            "golden": [
                {"height": g.height, "width": g.width, "channels": g.channels,
                 "pixels_b64": base64.b64encode(g.pixels).decode("ascii"), "expected_top1": g.expected_top1}
                for g in c.golden
            ],
        }
    if manifest.generator is not None:
        g = manifest.generator
        data["generator"] = {
            "inputs": {"max_seq_len": g.max_seq_len},
            "tokenizer": asdict(g.tokenizer),
            "architecture": asdict(g.architecture),
            "golden": [{"prompt_ids": list(x.prompt_ids), "expected_ids": list(x.expected_ids)} for x in g.golden],
        }
    data["quality"] = dict(manifest.quality)
    data["build"] = dict(manifest.build)
    return data


def write_manifest(manifest: Manifest, directory: Path) -> Path:
    """Validates by round-tripping, then writes `directory/manifest.json`."""
    data = manifest_to_dict(manifest)
    parse_manifest(data, source=str(directory / MANIFEST_FILE))
    path = directory / MANIFEST_FILE
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def parse_manifest(data: Any, *, source: str) -> Manifest:
    """A validated Manifest, or InvalidManifest naming the file and the offending field."""
    try:
        return _parse(_Obj(data, source, ""))
    except ValueError as exc:  # raised by the config dataclasses' own checks
        raise InvalidManifest(f"{source}: {exc}") from None


class _Obj:
    """A JSON object being read, with its path for error messages; rejects unknown keys."""

    def __init__(self, data: Any, source: str, path: str) -> None:
        if not isinstance(data, dict):
            raise InvalidManifest(f"{source}: {path or 'manifest'} must be an object, got {type(data).__name__}")
        self.data, self.source, self.path = data, source, path

    def fail(self, key: str, problem: str) -> InvalidManifest:
        return InvalidManifest(f"{self.source}: field '{self._at(key)}' {problem}")

    def _at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def allow_only(self, *keys: str) -> None:
        unknown = sorted(set(self.data) - set(keys))
        if unknown:
            raise InvalidManifest(f"{self.source}: unknown field(s) {unknown} in {self.path or 'manifest'}")

    def raw(self, key: str) -> Any:
        if key not in self.data:
            raise InvalidManifest(f"{self.source}: missing field '{self._at(key)}'")
        return self.data[key]

    def obj(self, key: str) -> _Obj:
        return _Obj(self.raw(key), self.source, self._at(key))

    def text(self, key: str, pattern: re.Pattern[str] | None = None) -> str:
        value = self.raw(key)
        if not isinstance(value, str) or not value:
            raise self.fail(key, f"must be a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise self.fail(key, f"must match {pattern.pattern}, got {value!r}")
        return value

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self.raw(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def number(self, key: str) -> float:
        value = self.raw(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r}")
        return float(value)

    def array(self, key: str, min_len: int = 0) -> list[Any]:
        value = self.raw(key)
        if not isinstance(value, list) or len(value) < min_len:
            raise self.fail(key, f"must be a list of at least {min_len} entries, got {value!r:.80}")
        return value

    def ints(self, key: str, lo: int, hi: int, min_len: int = 1) -> tuple[int, ...]:
        values = self.array(key, min_len)
        if not all(isinstance(v, int) and not isinstance(v, bool) and lo <= v < hi for v in values):
            raise self.fail(key, f"must hold integers in [{lo}, {hi})")
        return tuple(values)

    def numbers(self, key: str, length: int) -> tuple[float, ...]:
        values = self.array(key)
        if len(values) != length or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise self.fail(key, f"must be {length} numbers, got {values!r}")
        return tuple(float(v) for v in values)

    def items(self, key: str, min_len: int) -> list[_Obj]:
        return [_Obj(v, self.source, f"{self._at(key)}[{i}]") for i, v in enumerate(self.array(key, min_len))]


def _parse(o: _Obj) -> Manifest:
    o.allow_only("format_version", "name", "version", "kind", "weights", "envelope", "classifier", "generator",
                 "quality", "build")
    if o.raw("format_version") != FORMAT_VERSION:
        raise o.fail("format_version", f"must be {FORMAT_VERSION}, got {o.raw('format_version')!r}")
    name = o.text("name", _NAME_RE)
    version = o.text("version", _NAME_RE)
    if version == "latest":
        raise o.fail("version", "must be an exact version; 'latest' is not allowed")
    kind_text = o.text("kind")
    try:
        kind = ModelKind(kind_text)
    except ValueError:
        raise o.fail("kind", f"must be 'classifier' or 'generator', got {kind_text!r}") from None
    other = "generator" if kind is ModelKind.CLASSIFIER else "classifier"
    if other in o.data:
        raise o.fail(other, f"must be absent for a {kind.value}")
    w = o.obj("weights")
    w.allow_only("file", "sha256")
    weights_file = w.text("file")
    if "/" in weights_file or "\\" in weights_file or weights_file.startswith("."):
        raise w.fail("file", f"must be a plain file name inside the version directory, got {weights_file!r}")
    weights = WeightsRef(weights_file, w.text("sha256", _SHA256_RE))
    envelope = _parse_envelope(o.obj("envelope"), kind)
    classifier = _parse_classifier(o.obj("classifier")) if kind is ModelKind.CLASSIFIER else None
    generator = _parse_generator(o.obj("generator"), envelope) if kind is ModelKind.GENERATOR else None
    quality = {}
    if "quality" in o.data:
        q = o.obj("quality")
        quality = {k: q.number(k) for k in q.data}
    build = {}
    if "build" in o.data:
        b = o.obj("build")
        build = {k: b.text(k) for k in b.data}
    return Manifest(name, version, kind, weights, envelope, classifier, generator, quality, build)


def _parse_envelope(e: _Obj, kind: ModelKind) -> Envelope:
    e.allow_only(*(f.name for f in fields(Envelope)))
    needed = {"max_batch_size"} if kind is ModelKind.CLASSIFIER else {
        "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size"}
    return Envelope(**{f.name: e.integer(f.name, 1 if f.name in needed else 0) for f in fields(Envelope)})


def _parse_classifier(c: _Obj) -> ClassifierSpec:
    c.allow_only("inputs", "labels", "architecture", "golden")
    i = c.obj("inputs")
    i.allow_only(*(f.name for f in fields(ClassifierInputs)))
    channels = i.integer("channels", 1)
    if channels not in (1, 3):
        raise i.fail("channels", f"must be 1 or 3, got {channels}")
    inputs = ClassifierInputs(
        input_height=i.integer("input_height", 1), input_width=i.integer("input_width", 1), channels=channels,
        max_image_pixels=i.integer("max_image_pixels", 1), mean=i.numbers("mean", channels), std=i.numbers("std", channels),
    )
    if any(s <= 0 for s in inputs.std):
        raise i.fail("std", f"entries must be > 0, got {list(inputs.std)}")
    a = c.obj("architecture")
    a.allow_only(*(f.name for f in fields(CnnConfig)))
    architecture = CnnConfig(
        num_classes=a.integer("num_classes", 1), in_channels=a.integer("in_channels", 1),
        input_height=a.integer("input_height", 1), input_width=a.integer("input_width", 1),
        conv_channels=a.ints("conv_channels", 1, 1 << 16), hidden_size=a.integer("hidden_size", 1),
    )
    if (architecture.in_channels, architecture.input_height, architecture.input_width) != (
        inputs.channels, inputs.input_height, inputs.input_width
    ):
        raise a.fail("in_channels", "and input_height/input_width must equal classifier.inputs")
    labels = c.array("labels", 1)
    if not all(isinstance(x, str) and x for x in labels) or len(set(labels)) != len(labels):
        raise c.fail("labels", f"must be distinct non-empty strings, got {labels!r}")
    if len(labels) != architecture.num_classes:
        raise c.fail("labels", f"has {len(labels)} entries but architecture.num_classes is {architecture.num_classes}")
    golden = tuple(_parse_golden_image(g, architecture.num_classes) for g in c.items("golden", 1))
    return ClassifierSpec(inputs, tuple(labels), architecture, golden)


def _parse_golden_image(g: _Obj, num_classes: int) -> GoldenImage:
    g.allow_only("height", "width", "channels", "pixels_b64", "expected_top1")
    height, width, channels = g.integer("height", 1), g.integer("width", 1), g.integer("channels", 1)
    try:
        pixels = base64.b64decode(g.text("pixels_b64"), validate=True)
    except binascii.Error as exc:
        raise g.fail("pixels_b64", f"is not valid base64: {exc}") from None
    if len(pixels) != height * width * channels:
        raise g.fail("pixels_b64", f"decodes to {len(pixels)} bytes, expected {height}*{width}*{channels}")
    expected = g.integer("expected_top1")
    if expected >= num_classes:
        raise g.fail("expected_top1", f"must be < num_classes {num_classes}, got {expected}")
    return GoldenImage(height, width, channels, pixels, expected)


def _parse_generator(g: _Obj, envelope: Envelope) -> GeneratorSpec:
    g.allow_only("inputs", "tokenizer", "architecture", "golden")
    i = g.obj("inputs")
    i.allow_only("max_seq_len")
    max_seq_len = i.integer("max_seq_len", 1)
    t = g.obj("tokenizer")
    t.allow_only(*(f.name for f in fields(TokenizerSpec)))
    if t.text("kind") != "bytes":
        raise t.fail("kind", f"must be 'bytes' (the only tokenizer), got {t.raw('kind')!r}")
    vocab_size = t.integer("vocab_size", 257)
    eos = t.integer("eos_token_id", 256)
    bos = t.raw("bos_token_id")
    if bos != -1:
        bos = t.integer("bos_token_id", 256)
    if eos >= vocab_size or bos >= vocab_size or bos == eos:
        raise t.fail("eos_token_id", f"and bos_token_id must be distinct special ids < vocab_size {vocab_size}")
    tokenizer = TokenizerSpec("bytes", vocab_size, eos, bos)
    a = g.obj("architecture")
    a.allow_only(*(f.name for f in fields(TransformerConfig)))
    architecture = TransformerConfig(
        vocab_size=a.integer("vocab_size", 1), num_layers=a.integer("num_layers", 1), d_model=a.integer("d_model", 1),
        num_heads=a.integer("num_heads", 1), num_kv_heads=a.integer("num_kv_heads", 1), d_ff=a.integer("d_ff", 1),
        rope_theta=a.number("rope_theta"), norm_eps=a.number("norm_eps"),
    )
    if architecture.vocab_size != vocab_size:
        raise a.fail("vocab_size", f"is {architecture.vocab_size} but tokenizer.vocab_size is {vocab_size}")
    if envelope.num_kv_blocks * envelope.block_size < max_seq_len:
        raise InvalidManifest(
            f"{g.source}: envelope holds {envelope.num_kv_blocks}*{envelope.block_size} KV slots, "
            f"fewer than one sequence of max_seq_len {max_seq_len}"
        )
    golden = []
    for x in g.items("golden", 1):
        x.allow_only("prompt_ids", "expected_ids")
        prompt, expected = x.ints("prompt_ids", 0, vocab_size), x.ints("expected_ids", 0, vocab_size)
        if len(prompt) + len(expected) > max_seq_len:
            raise x.fail("expected_ids", f"with the prompt exceeds max_seq_len {max_seq_len}")
        golden.append(GoldenGeneration(prompt, expected))
    return GeneratorSpec(max_seq_len, tokenizer, architecture, tuple(golden))


def _version_key(version: str) -> tuple[int, int | str]:
    return (0, int(version)) if version.isdigit() else (1, version)
