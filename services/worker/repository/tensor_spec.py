"""The manifest's `tensor` block (kind "tensor"): a TorchScript or ONNX model brought as it is.

    tensor: {
      format:  "torchscript" | "onnx"            (the file is `weights.file`, kept unchanged, sha256-pinned)
      inputs:  [{name, datatype, dims, image?}]   dims lead with the batch dim, -1; -1 elsewhere is dynamic
      outputs: [{name, datatype, dims, labels?}]  labels: one per entry of the last dim (classification)
      preferred_batch_sizes: [int]               Triton's preferred_batch_size; each <= envelope.max_batch_size
      golden:  [{inputs: [{name, shape, data_b64}], outputs: [...]}]   raw little-endian bytes
      golden_tolerance: {atol, rtol}             outputs at load match within these (np.allclose)
    }

An input with an `image` step takes uint8 HWC images of any size on the wire ([-1, -1, -1, C])
and the preprocessing kernel (resize, normalize) makes them the declared FP32 [-1, C, H, W].
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from services.common.tensor_datatypes import DATATYPES, ELEMENT_SIZE_BYTES
from services.worker.repository.envelope import Envelope
from services.worker.repository.json_fields import JsonFields, one_of

TORCHSCRIPT = "torchscript"
ONNX = "onnx"
FORMATS = (TORCHSCRIPT, ONNX)
TENSOR_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}$")
DYNAMIC = -1
IMAGE_WIRE_DATATYPE = "UINT8"


@dataclass(frozen=True)
class ImageStep:
    """The preprocessing kernel before this input: uint8 HWC images -> normalized float32 CHW."""

    channels: int  # 1 or 3; the declared input's dim 1
    mean: tuple[float, ...]  # per channel, 0..1 pixel units
    std: tuple[float, ...]
    max_image_pixels: int  # height * width limit checked before the kernel runs

    @classmethod
    def from_json(cls, i: JsonFields) -> ImageStep:
        i.allow_only("channels", "mean", "std", "max_image_pixels")
        channels = i.integer("channels", 1)
        if channels not in (1, 3):
            raise i.fail("channels", f"must be 1 or 3, got {channels}")
        step = cls(channels, i.numbers("mean", channels), i.numbers("std", channels), i.integer("max_image_pixels", 1))
        if any(s <= 0 for s in step.std):
            raise i.fail("std", f"entries must be > 0, got {list(step.std)}")
        return step

    def to_json(self) -> dict[str, Any]:
        return {"channels": self.channels, "mean": list(self.mean), "std": list(self.std),
                "max_image_pixels": self.max_image_pixels}


@dataclass(frozen=True)
class TensorIO:
    """One declared input or output of the model."""

    name: str
    datatype: str  # a KServe datatype (services/common/tensor_datatypes.py)
    dims: tuple[int, ...]  # dims[0] is the batch (-1); -1 elsewhere: any size
    image: ImageStep | None = None  # inputs only
    labels: tuple[str, ...] = ()  # outputs only: class names along the last dim

    @property
    def wire_datatype(self) -> str:
        """What a client sends: uint8 images for an input with an image step, else the declared type."""
        return IMAGE_WIRE_DATATYPE if self.image else self.datatype

    @property
    def wire_dims(self) -> tuple[int, ...]:
        return (DYNAMIC, DYNAMIC, DYNAMIC, self.image.channels) if self.image else self.dims

    def accepts(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of `shape` (batch dim included) fits the wire dims."""
        dims = self.wire_dims
        return len(shape) == len(dims) and shape[0] >= 1 and all(
            d == DYNAMIC and s >= 1 or d == s for d, s in zip(dims[1:], shape[1:], strict=True))

    @classmethod
    def from_json(cls, t: JsonFields, *, is_input: bool) -> TensorIO:
        t.allow_only("name", "datatype", "dims", "image" if is_input else "labels")
        name = t.text("name", TENSOR_NAME_RE)
        datatype = t.text("datatype")
        if datatype not in DATATYPES:
            raise t.fail("datatype", f"must be {one_of(DATATYPES)}, got {datatype!r}")
        dims = t.ints("dims", DYNAMIC, 1 << 31)
        if dims[0] != DYNAMIC:
            raise t.fail("dims", f"must lead with the batch dim as -1, got {list(dims)}")
        if 0 in dims:
            raise t.fail("dims", f"must be -1 (dynamic) or >= 1, got {list(dims)}")
        image = ImageStep.from_json(t.obj("image")) if is_input and "image" in t.data else None
        if image is not None and (datatype != "FP32" or len(dims) != 4 or dims[1] != image.channels
                                  or DYNAMIC in dims[2:]):
            raise t.fail("image", f"needs an FP32 input of dims [-1, {image.channels}, H, W] with H, W fixed, "
                                  f"got {datatype} {list(dims)}")
        labels: tuple[str, ...] = ()
        if not is_input and "labels" in t.data:
            raw = t.array("labels", 1)
            if not all(isinstance(x, str) and x for x in raw) or len(set(raw)) != len(raw):
                raise t.fail("labels", "must be distinct non-empty strings")
            if dims[-1] != len(raw) or len(dims) != 2:
                raise t.fail("labels", f"has {len(raw)} entries: the output's dims must be [-1, {len(raw)}], "
                                       f"got {list(dims)}")
            labels = tuple(raw)
        return cls(name, datatype, dims, image, labels)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "datatype": self.datatype, "dims": list(self.dims)}
        if self.image is not None:
            out["image"] = self.image.to_json()
        if self.labels:
            out["labels"] = list(self.labels)
        return out


@dataclass(frozen=True)
class GoldenTensor:
    name: str
    shape: tuple[int, ...]
    data: bytes  # raw little-endian elements of the tensor's (wire) datatype, row-major

    @classmethod
    def from_json(cls, g: JsonFields, declared: dict[str, TensorIO], *, wire: bool) -> GoldenTensor:
        g.allow_only("name", "shape", "data_b64")
        name = g.text("name")
        if name not in declared:
            raise g.fail("name", f"must be one of {sorted(declared)}, got {name!r}")
        io = declared[name]
        shape = g.ints("shape", 1, 1 << 31)
        datatype = io.wire_datatype if wire else io.datatype
        if not (io.accepts(shape) if wire else _fits(io.dims, shape)):
            raise g.fail("shape", f"{list(shape)} does not fit {name!r} dims {list(io.wire_dims if wire else io.dims)}")
        try:
            data = base64.b64decode(g.text("data_b64"), validate=True)
        except binascii.Error as exc:
            raise g.fail("data_b64", f"is not valid base64: {exc}") from None
        expected = math.prod(shape) * ELEMENT_SIZE_BYTES[datatype]
        if len(data) != expected:
            raise g.fail("data_b64", f"decodes to {len(data)} bytes; {datatype} {list(shape)} is {expected}")
        return cls(name, shape, data)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "data_b64": base64.b64encode(self.data).decode("ascii")}


@dataclass(frozen=True)
class GoldenCase:
    inputs: tuple[GoldenTensor, ...]  # one per declared input, on the wire (images as uint8 HWC)
    outputs: tuple[GoldenTensor, ...]  # one per declared output

    @classmethod
    def from_json(cls, g: JsonFields, inputs: tuple[TensorIO, ...], outputs: tuple[TensorIO, ...]) -> GoldenCase:
        g.allow_only("inputs", "outputs")
        got_in = tuple(GoldenTensor.from_json(x, {i.name: i for i in inputs}, wire=True) for x in g.items("inputs", 1))
        got_out = tuple(GoldenTensor.from_json(x, {o.name: o for o in outputs}, wire=False)
                        for x in g.items("outputs", 1))
        for key, got, want in (("inputs", got_in, inputs), ("outputs", got_out, outputs)):
            if sorted(t.name for t in got) != sorted(t.name for t in want):
                raise g.fail(key, f"must name each of {[t.name for t in want]} once, got {[t.name for t in got]}")
        if len({t.shape[0] for t in got_in + got_out}) != 1:
            raise g.fail("inputs", "and outputs must share one batch size (dim 0)")
        return cls(got_in, got_out)

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [t.to_json() for t in self.inputs], "outputs": [t.to_json() for t in self.outputs]}


@dataclass(frozen=True)
class TensorSpec:
    format: str  # "torchscript" | "onnx"
    inputs: tuple[TensorIO, ...]  # in the order the model takes them (TorchScript: positional)
    outputs: tuple[TensorIO, ...]  # in the order the model returns them
    preferred_batch_sizes: tuple[int, ...]
    golden: tuple[GoldenCase, ...]
    golden_atol: float
    golden_rtol: float

    ENVELOPE_NEEDS: ClassVar[frozenset[str]] = frozenset({"max_batch_size"})

    def input(self, name: str) -> TensorIO | None:
        return next((i for i in self.inputs if i.name == name), None)

    @classmethod
    def from_json(cls, t: JsonFields, envelope: Envelope) -> TensorSpec:
        t.allow_only("format", "inputs", "outputs", "preferred_batch_sizes", "golden", "golden_tolerance")
        fmt = t.text("format")
        if fmt not in FORMATS:
            raise t.fail("format", f"must be {one_of(FORMATS)}, got {fmt!r}")
        inputs = tuple(TensorIO.from_json(x, is_input=True) for x in t.items("inputs", 1))
        outputs = tuple(TensorIO.from_json(x, is_input=False) for x in t.items("outputs", 1))
        names = [x.name for x in inputs + outputs]
        if len(set(names)) != len(names):
            raise t.fail("inputs", f"and outputs must have distinct names, got {names}")
        preferred = t.ints("preferred_batch_sizes", 1, envelope.max_batch_size + 1, min_len=0) \
            if "preferred_batch_sizes" in t.data else ()
        if list(preferred) != sorted(set(preferred)):
            raise t.fail("preferred_batch_sizes", f"must be increasing, got {list(preferred)}")
        golden = tuple(GoldenCase.from_json(g, inputs, outputs) for g in t.items("golden", 1))
        for i, case in enumerate(golden):
            if case.inputs[0].shape[0] > envelope.max_batch_size:
                raise t.fail(f"golden[{i}]", f"has a batch above envelope.max_batch_size {envelope.max_batch_size}")
        tol = t.obj("golden_tolerance")
        tol.allow_only("atol", "rtol")
        atol, rtol = tol.number("atol"), tol.number("rtol")
        if atol < 0 or rtol < 0:
            raise tol.fail("atol", f"and rtol must be >= 0, got {atol}, {rtol}")
        return cls(fmt, inputs, outputs, tuple(preferred), golden, atol, rtol)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "inputs": [x.to_json() for x in self.inputs],
            "outputs": [x.to_json() for x in self.outputs],
            "preferred_batch_sizes": list(self.preferred_batch_sizes),
            "golden": [g.to_json() for g in self.golden],
            "golden_tolerance": {"atol": self.golden_atol, "rtol": self.golden_rtol},
        }


def _fits(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return len(dims) == len(shape) and all(d == DYNAMIC or d == s for d, s in zip(dims, shape, strict=True))
