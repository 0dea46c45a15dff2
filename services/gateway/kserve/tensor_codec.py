"""KServe v2 tensors <-> infermesh Classify for tensor models (MODEL_KIND_TENSOR).

A request's inputs are checked against the model's declared inputs (ModelInfo.tensor_inputs):
every input once, its datatype, its shape (batch first, fixed dims as declared), the element
count, and a batch of at most the model's max_batch_size. Each refusal is INVALID_ARGUMENT
naming the input and what was expected. Data comes from `raw_input_contents` (what tritonclient
sends) or from the datatype's typed `contents`, and goes upstream as raw little-endian bytes,
one Classify call per batch row, so the scheduler's dynamic batcher stacks rows across callers.
Outputs go out as `raw_output_contents`, rows in the request's order; an output asked for with
the classification extension (`classification: k`) is BYTES [N, k] of "score:index[:label]",
highest first, as Triton writes it.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import Internal, InvalidArgument
from services.common.tensor_datatypes import ELEMENT_SIZE_BYTES, STRUCT_CODES
from services.gateway.kserve.codec import RequestedOutput, pack_bytes_tensor, requested_among

# The typed contents field each datatype's values travel in (KServe v2); FP16 has none: raw only.
_CONTENTS_FIELD = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                   "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
                   "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
                   "FP32": "fp32_contents", "FP64": "fp64_contents"}


@dataclass(frozen=True)
class TensorRows:
    """A checked request: each batch row's inputs (batch 1), in row order."""

    rows: tuple[tuple[common_pb2.Tensor, ...], ...]


def is_tensor(info: gateway_pb2.ModelInfo) -> bool:
    return info.kind == common_pb2.MODEL_KIND_TENSOR


def decode_rows(request: kserve.ModelInferRequest, info: gateway_pb2.ModelInfo, max_batch_size: int) -> TensorRows:
    declared = {t.name: t for t in info.tensor_inputs}
    names = [t.name for t in request.inputs]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"an input is given more than once: {names}")
    extra = sorted(set(names) - set(declared))
    if extra:
        raise InvalidArgument(f"unexpected input(s) {extra}; model {info.model.name} takes {list(declared)}")
    missing = [name for name in declared if name not in names]
    if missing:
        raise InvalidArgument(f"missing input(s) {missing}; model {info.model.name} takes {list(declared)}")
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidArgument(f"raw_input_contents has {len(request.raw_input_contents)} entries for "
                              f"{len(request.inputs)} inputs")
    tensors = {}
    for index, tensor in enumerate(request.inputs):
        raw = request.raw_input_contents[index] if request.raw_input_contents else None
        tensors[tensor.name] = _checked(tensor, raw, declared[tensor.name], max_batch_size)
    batches = {name: t.shape[0] for name, t in tensors.items()}
    if len(set(batches.values())) != 1:
        raise InvalidArgument(f"inputs must share one batch size (dim 0), got {batches}")
    num_rows = next(iter(batches.values()))
    ordered = [tensors[name] for name in declared]
    return TensorRows(tuple(tuple(_row(t, i) for t in ordered) for i in range(num_rows)))


def _checked(tensor: kserve.ModelInferRequest.InferInputTensor, raw: bytes | None, declared: common_pb2.TensorMetadata,
             max_batch_size: int) -> common_pb2.Tensor:
    name, datatype, shape, dims = tensor.name, tensor.datatype, list(tensor.shape), list(declared.dims)
    if datatype != declared.datatype:
        raise InvalidArgument(f"input '{name}' must be {declared.datatype}, got {datatype or '(none)'}")
    if len(shape) != len(dims) or shape[0] < 1 or any(
            s < 1 or (d != -1 and s != d) for d, s in zip(dims[1:], shape[1:], strict=True)):
        raise InvalidArgument(f"input '{name}' must have shape {dims} (-1: any size >= 1), got {shape}")
    if shape[0] > max_batch_size:
        raise InvalidArgument(f"input '{name}' has a batch of {shape[0]}; the model takes at most "
                              f"{max_batch_size} (its max_batch_size)")
    num_elements = math.prod(shape)
    typed = [field.name for field, _ in tensor.contents.ListFields()]
    if raw is not None and typed:  # Triton refuses this too: which of the two is the input?
        raise InvalidArgument(f"input '{name}' has both raw_input_contents and contents.{typed[0]}; send one")
    if raw is None:
        raw = _typed_to_raw(name, datatype, tensor.contents, typed, num_elements)
    expected = num_elements * ELEMENT_SIZE_BYTES[datatype]
    if len(raw) != expected:
        raise InvalidArgument(f"input '{name}' {datatype} {shape} needs {expected} bytes "
                              f"({num_elements} elements), got {len(raw)}")
    return common_pb2.Tensor(name=name, datatype=datatype, shape=shape, data=raw)


def _typed_to_raw(name: str, datatype: str, contents: kserve.InferTensorContents, typed: list[str],
                  num_elements: int) -> bytes:
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        raise InvalidArgument(f"input '{name}' is {datatype}: send it in raw_input_contents (it has no typed contents)")
    if any(other != field for other in typed):
        raise InvalidArgument(f"input '{name}' is {datatype}: its values go in contents.{field}, "
                              f"got contents.{next(other for other in typed if other != field)}")
    values = list(getattr(contents, field))
    if len(values) != num_elements:
        raise InvalidArgument(f"input '{name}' has {len(values)} elements in contents.{field}, expected {num_elements}")
    try:
        return struct.pack(f"<{len(values)}{STRUCT_CODES[datatype]}", *values)
    except struct.error:
        raise InvalidArgument(f"input '{name}': a value is out of range for {datatype}") from None


def _row(tensor: common_pb2.Tensor, index: int) -> common_pb2.Tensor:
    row_bytes = len(tensor.data) // tensor.shape[0]
    return common_pb2.Tensor(name=tensor.name, datatype=tensor.datatype, shape=[1, *tensor.shape[1:]],
                             data=tensor.data[index * row_bytes:(index + 1) * row_bytes])


def requested_outputs(request: kserve.ModelInferRequest, info: gateway_pb2.ModelInfo) -> tuple[RequestedOutput, ...]:
    declared = {t.name: t for t in info.tensor_outputs}
    wanted = requested_among(request, list(declared), f"model {info.model.name} has {list(declared)}")
    for output in wanted:
        if output.class_count and (len(declared[output.name].dims) != 2
                                   or declared[output.name].datatype not in STRUCT_CODES):
            raise InvalidArgument(f"output '{output.name}' is not a score vector [-1, classes]; "
                                  "classification applies to those")
    return wanted


def encode_outputs(response: kserve.ModelInferResponse, requested: Sequence[RequestedOutput],
                   answers: Sequence[gateway_pb2.ClassifyResponse], info: gateway_pb2.ModelInfo) -> None:
    """Each requested output: the rows' tensors stacked on dim 0, in row order."""
    declared = {t.name: t for t in info.tensor_outputs}
    for output in requested:
        parts = [next((t for t in answer.outputs if t.name == output.name), None) for answer in answers]
        if any(p is None for p in parts):
            raise Internal(f"the worker returned no output '{output.name}'")
        rows = [p for p in parts if p is not None]
        if len({tuple(p.shape[1:]) for p in rows}) != 1 or len({p.datatype for p in rows}) != 1:
            raise Internal(f"output '{output.name}' rows differ in shape or datatype: "
                           f"{sorted({(p.datatype, tuple(p.shape)) for p in rows})}")
        shape = [sum(p.shape[0] for p in rows), *rows[0].shape[1:]]
        data = b"".join(p.data for p in rows)
        tensor = response.outputs.add(name=output.name)
        if output.class_count:
            entries = _top_entries(data, rows[0].datatype, shape, output.class_count, declared[output.name].labels)
            tensor.datatype, tensor.shape[:] = "BYTES", [shape[0], min(output.class_count, shape[1])]
            response.raw_output_contents.append(pack_bytes_tensor(entries))
        else:
            tensor.datatype, tensor.shape[:] = rows[0].datatype, shape
            response.raw_output_contents.append(data)


def _top_entries(data: bytes, datatype: str, shape: list[int], class_count: int, labels: Sequence[str]) -> list[bytes]:
    num_rows, num_classes = shape
    values = struct.unpack(f"<{num_rows * num_classes}{STRUCT_CODES[datatype]}", data)
    entries = []
    for r in range(num_rows):
        row = values[r * num_classes:(r + 1) * num_classes]
        for i in sorted(range(num_classes), key=lambda i: -row[i])[:class_count]:
            entries.append((f"{row[i]:f}:{i}:{labels[i]}" if labels else f"{row[i]:f}:{i}").encode())
    return entries
