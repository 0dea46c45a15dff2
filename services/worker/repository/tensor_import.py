"""A TorchScript or ONNX file -> a `kind: tensor` version directory: the file unchanged, a manifest.

What the file says is read from it: an ONNX graph's inputs and outputs (names, element types,
ranks, which dims are symbolic). What it cannot say comes from flags, and an import that lacks
one is refused naming the flag: a TorchScript module's inputs (`--input NAME:DATATYPE:DIMS`), an
ONNX input whose batch dim is fixed. Outputs are learned by running the model on example inputs
twice, with the dynamic dims at two sizes: a dim that changes with them is dynamic. Golden cases
are those runs' outputs, recorded with the tolerance given, and the version is loaded and
golden-checked like any other before the import reports success.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common.tensor_datatypes import DATATYPES, NUMPY_DTYPES
from services.worker.models.tensor_model import (
    ONNX_TYPES,
    OnnxModel,
    TorchScriptModel,
    short_error,
    unloadable_onnx_message,
)
from services.worker.repository.envelope import Envelope
from services.worker.repository.errors import ImportRefused, InvalidManifest, ModelRepositoryError
from services.worker.repository.manifest import NAME_RE, Manifest, ModelKind
from services.worker.repository.store import check_new_version, sha256_of, version_dir, write_manifest
from services.worker.repository.tensor_spec import (
    DYNAMIC,
    ONNX,
    TENSOR_NAME_RE,
    TORCHSCRIPT,
    GoldenCase,
    GoldenTensor,
    ImageStep,
    TensorIO,
    TensorSpec,
)
from services.worker.repository.weights_spec import WeightsRef

ONNX_SUFFIXES = (".onnx",)
TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts", ".torchscript")
_DATATYPE_OF_ONNX = {v: k for k, v in ONNX_TYPES.items()}
# Sizes the dynamic dims take in the two example runs (batch 1 and 2, other dims 2 and 3).
_EXAMPLE_SIZES = ((1, 2), (2, 3))
# Integer inputs draw from [0, _INT_HIGH): valid as indices for any embedding a model may hold.
_INT_HIGH = 2


@dataclass(frozen=True)
class ImageFlags:
    input_name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    max_image_pixels: int


@dataclass(frozen=True)
class ImportRequest:
    source: Path
    name: str
    version: str
    repository: Path
    inputs: tuple[TensorIO, ...] = ()  # --input: TorchScript's inputs, or overrides of an ONNX graph's
    output_names: tuple[str, ...] = ()  # --output: TorchScript's output names, in order
    max_batch_size: int = 8
    preferred_batch_sizes: tuple[int, ...] = ()
    image: ImageFlags | None = None
    golden_atol: float = 1e-4
    golden_rtol: float = 1e-3
    seed: int = 0


def model_format(source: Path) -> str:
    """"onnx" or "torchscript", by the file's suffix (ImportRefused for anything else)."""
    suffix = source.suffix.lower()
    if suffix in ONNX_SUFFIXES:
        return ONNX
    if suffix in TORCHSCRIPT_SUFFIXES:
        return TORCHSCRIPT
    raise ImportRefused(f"{source}: not a model file this import reads (ONNX: {', '.join(ONNX_SUFFIXES)}; "
                        f"TorchScript: {', '.join(TORCHSCRIPT_SUFFIXES)})")


def parse_input_flag(text: str) -> TensorIO:
    """`NAME:DATATYPE:DIMS` (DIMS comma-separated, batch first as -1), as --input gives it."""
    parts = text.split(":")
    if len(parts) != 3:
        raise ImportRefused(f"--input {text!r}: expected NAME:DATATYPE:DIMS, e.g. x:FP32:-1,3,32,32")
    name, datatype, dims_text = parts
    if not TENSOR_NAME_RE.match(name):
        raise ImportRefused(f"--input {text!r}: {name!r} is not a tensor name ({TENSOR_NAME_RE.pattern})")
    if datatype not in DATATYPES:
        raise ImportRefused(f"--input {text!r}: datatype must be one of {', '.join(DATATYPES)}")
    try:
        dims = tuple(int(d) for d in dims_text.split(","))
    except ValueError:
        raise ImportRefused(f"--input {text!r}: DIMS must be integers separated by commas") from None
    if dims[0] != DYNAMIC or any(d == 0 or d < DYNAMIC for d in dims):
        raise ImportRefused(f"--input {text!r}: DIMS lead with the batch dim -1, then sizes >= 1 or -1")
    return TensorIO(name, datatype, dims)


def import_tensor_model(request: ImportRequest) -> Path:
    """Writes `<repository>/<name>/<version>/` (the file copied unchanged, manifest.json) and returns it."""
    fmt = model_format(request.source)
    if not request.source.is_file():
        raise ImportRefused(f"{request.source}: no such file")
    for what, value in (("--name", request.name), ("--version", request.version)):
        if not NAME_RE.match(value) or value == "latest":
            raise ImportRefused(f"{what} {value!r} must match {NAME_RE.pattern} (and not be 'latest')")
    directory = version_dir(request.repository, request.name, request.version)
    check_new_version(directory)
    inputs = _declared_inputs(request, fmt)
    if request.max_batch_size < 1:
        raise ImportRefused(f"--max-batch-size must be >= 1, got {request.max_batch_size}")
    outputs, golden = _learn_outputs(request, fmt, inputs)
    spec = TensorSpec(fmt, inputs, outputs, request.preferred_batch_sizes, golden, request.golden_atol,
                      request.golden_rtol)
    directory.mkdir(parents=True)
    try:
        target = directory / request.source.name
        shutil.copyfile(request.source, target)
        envelope = Envelope(max_batch_size=request.max_batch_size, max_num_seqs=0, max_num_batched_tokens=0,
                            num_kv_blocks=0, block_size=0, memory_bytes=target.stat().st_size)
        manifest = Manifest(request.name, request.version, ModelKind.TENSOR,
                            WeightsRef(target.name, sha256_of(target)), envelope, tensor=spec,
                            build={"tool": "infermesh models import", "source": request.source.name})
        write_manifest(manifest, directory)
    except BaseException:
        shutil.rmtree(directory)
        raise
    return directory


def _declared_inputs(request: ImportRequest, fmt: str) -> tuple[TensorIO, ...]:
    given = {io.name: io for io in request.inputs}
    if fmt == TORCHSCRIPT:
        if not request.inputs:
            raise ImportRefused(f"{request.source}: a TorchScript module does not record its inputs' names, types "
                                "or shapes: give each with --input NAME:DATATYPE:DIMS, in the order forward() "
                                "takes them (e.g. --input x:FP32:-1,3,32,32)")
        inputs = request.inputs
    else:
        inputs = tuple(given.pop(io.name, io) for io in _onnx_inputs(request.source))
        if given:
            raise ImportRefused(f"--input names {sorted(given)} that the graph does not have")
    return tuple(_with_image(io, request.image) for io in inputs)


def _onnx_inputs(source: Path) -> list[TensorIO]:
    session = _onnx_session(source)
    declared = []
    for arg in session.get_inputs():
        datatype = _DATATYPE_OF_ONNX.get(arg.type)
        if datatype is None:
            raise ImportRefused(f"{source}: input {arg.name!r} is {arg.type}, which tensor models do not serve "
                                f"(they take {', '.join(DATATYPES)})")
        dims = tuple(d if isinstance(d, int) and d > 0 else DYNAMIC for d in arg.shape)
        if not dims or dims[0] != DYNAMIC:
            raise ImportRefused(f"{source}: input {arg.name!r} has a fixed batch dim {arg.shape}; export it with a "
                                f"dynamic dim 0 (torch.onnx.export dynamic_axes={{{arg.name!r}: {{0: 'batch'}}}}) "
                                f"or give --input {arg.name}:{datatype}:-1,... to declare it")
        declared.append(TensorIO(arg.name, datatype, dims))
    return declared


def _onnx_session(source: Path):
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own pybind error classes
        raise ImportRefused(unloadable_onnx_message(source, str(exc), ort.__version__)) from None


def _with_image(io: TensorIO, image: ImageFlags | None) -> TensorIO:
    if image is None or image.input_name != io.name:
        return io
    channels = len(image.mean)
    if io.datatype != "FP32" or len(io.dims) != 4 or io.dims[1] != channels or DYNAMIC in io.dims[2:]:
        raise ImportRefused(f"--image-input {io.name}: the input must be FP32 [-1, {channels}, H, W] with H and W "
                            f"fixed, it is {io.datatype} {list(io.dims)}")
    return TensorIO(io.name, io.datatype, io.dims, ImageStep(channels, image.mean, image.std, image.max_image_pixels))


def _learn_outputs(request: ImportRequest, fmt: str,
                   inputs: tuple[TensorIO, ...]) -> tuple[tuple[TensorIO, ...], tuple[GoldenCase, ...]]:
    """Runs the model at two example sizes: outputs' types and dims, and the runs as golden cases."""
    model, names = _open_unnamed(request, fmt, inputs)
    rng = np.random.default_rng(request.seed)
    runs = []
    for batch, other in _EXAMPLE_SIZES:
        wire = {io.name: _example(io, batch, other, rng) for io in inputs}
        feed = {io.name: _model_input(io, wire[io.name]) for io in inputs}
        try:
            got = model.run_positional(feed)
        except ModelRepositoryError:
            raise
        except Exception as exc:
            shapes = {k: list(v.shape) for k, v in feed.items()}
            raise ImportRefused(f"{request.source}: the model fails on example inputs {shapes}: "
                                f"{short_error(exc)}; check the "
                                "--input dims (a fixed dim where the model takes one size, -1 where it takes any)"
                                ) from None
        if names is None:
            names = tuple(f"output{i}" for i in range(len(got)))
        if len(got) != len(names):
            raise ImportRefused(f"{request.source}: forward() returns {len(got)} tensors but --output names "
                                f"{len(names)}: give one --output per returned tensor, in order")
        runs.append((wire, got))
    assert names is not None
    outputs = tuple(_output_io(name, [r[1][i] for r in runs]) for i, name in enumerate(names))
    golden = tuple(
        GoldenCase(tuple(_golden(io.name, wire[io.name]) for io in inputs),
                   tuple(_golden(o.name, array) for o, array in zip(outputs, arrays, strict=True)))
        for wire, arrays in runs if wire[inputs[0].name].shape[0] <= request.max_batch_size)
    return outputs, golden


def _open_unnamed(request: ImportRequest, fmt: str,
                  inputs: tuple[TensorIO, ...]) -> tuple[TorchScriptModel | OnnxModel, tuple[str, ...] | None]:
    """The model opened before its outputs are known, and their names (None: TorchScript's, unnamed)."""
    if fmt == TORCHSCRIPT:
        spec = TensorSpec(fmt, inputs, (TensorIO("unknown", "FP32", (DYNAMIC,)),), (), (), 0.0, 0.0)
        return TorchScriptModel(spec, request.source, "cpu"), request.output_names or None
    if request.output_names:
        raise ImportRefused("--output is for TorchScript; an ONNX graph names its outputs")
    outputs = []
    for arg in _onnx_session(request.source).get_outputs():
        datatype = _DATATYPE_OF_ONNX.get(arg.type)
        if datatype is None:
            raise ImportRefused(f"{request.source}: output {arg.name!r} is {arg.type}, which tensor models do not "
                                f"serve (they return {', '.join(DATATYPES)})")
        outputs.append(TensorIO(arg.name, datatype, (DYNAMIC,) * max(1, len(arg.shape))))
    spec = TensorSpec(fmt, inputs, tuple(outputs), (), (), 0.0, 0.0)
    return OnnxModel(spec, request.source, "cpu", 1), tuple(o.name for o in outputs)


def _example(io: TensorIO, batch: int, other: int, rng: np.random.Generator) -> np.ndarray:
    """A wire tensor for `io`: batch rows, `other` for each dynamic dim (images: 2*other+6 square)."""
    if io.image is not None:
        side = 2 * other + 6
        return rng.integers(0, 256, size=(batch, side, side, io.image.channels), dtype=np.uint8)
    shape = tuple(batch if i == 0 else (other if d == DYNAMIC else d) for i, d in enumerate(io.dims))
    dtype = np.dtype(NUMPY_DTYPES[io.datatype])
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    return rng.integers(0, _INT_HIGH, size=shape).astype(dtype)


def _model_input(io: TensorIO, wire: np.ndarray) -> np.ndarray:
    if io.image is None:
        return wire
    from kernels import preprocess_images

    return np.asarray(preprocess_images(list(wire), io.dims[2], io.dims[3], io.image.mean, io.image.std))


def _output_io(name: str, arrays: Sequence[np.ndarray]) -> TensorIO:
    first = arrays[0]
    datatype = next((k for k, v in NUMPY_DTYPES.items() if np.dtype(v) == first.dtype.newbyteorder("<")), None)
    if datatype is None or first.ndim == 0:
        raise ImportRefused(f"output {name!r} is {first.dtype} of shape {list(first.shape)}; tensor models return "
                            f"batched tensors of {', '.join(DATATYPES)}")
    if any(a.ndim != first.ndim for a in arrays):
        raise ImportRefused(f"output {name!r} changes rank with the input sizes")
    dims = tuple(DYNAMIC if i == 0 or len({a.shape[i] for a in arrays}) > 1 else first.shape[i]
                 for i in range(first.ndim))
    return TensorIO(name, datatype, dims)


def _golden(name: str, array: np.ndarray) -> GoldenTensor:
    contiguous = np.ascontiguousarray(array)
    if contiguous.dtype.byteorder == ">":
        contiguous = contiguous.astype(contiguous.dtype.newbyteorder("<"))
    if math.prod(contiguous.shape) == 0:
        raise InvalidManifest(f"tensor {name!r} of the example run is empty {list(contiguous.shape)}")
    return GoldenTensor(name, tuple(contiguous.shape), contiguous.tobytes())
