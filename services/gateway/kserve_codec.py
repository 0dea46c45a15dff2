"""KServe v2 tensors <-> infermesh classify: the input image and the output tensors.

Contract (docs/gateway.md):
  input  IMAGE  UINT8  [H, W, C] or [1, H, W, C], C in 1, 3, 4: raw pixels, row-major HWC
         IMAGE  BYTES  [1] or [1, 1]: one PNG or JPEG file
  output PROBABILITIES  FP32  [num_classes]: softmax score per class index
         LABELS         BYTES [num_classes]: class names, same order
  An output requested with the classification extension (parameter
  `classification: k`, tritonclient's `class_count=k`) is instead BYTES [k]
  of "score:index:label", most probable first, as Triton writes it.
Data comes from `raw_input_contents` (as tritonclient sends it) or from typed
`contents` (uint_contents / bytes_contents); outputs go out as
`raw_output_contents`, in the order of `outputs`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2
from services.common.errors import InvalidArgument

INPUT_NAME = "IMAGE"
PROBABILITIES = "PROBABILITIES"
LABELS = "LABELS"
OUTPUT_NAMES = (PROBABILITIES, LABELS)
_CHANNELS = (1, 3, 4)


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    # > 0: Triton's classification extension, top `class_count` as "score:index:label".
    class_count: int = 0


@dataclass(frozen=True)
class ClassScores:
    """Every class's score, by class index; labels in the same order."""

    labels: tuple[str, ...]
    scores: tuple[float, ...]


def decode_image(request: kserve.ModelInferRequest) -> common_pb2.Image:
    inputs = list(request.inputs)
    names = [tensor.name for tensor in inputs]
    if names.count(INPUT_NAME) != 1 or len(inputs) != 1:
        raise InvalidArgument(f"expected exactly one input named '{INPUT_NAME}', got {names}")
    tensor = inputs[0]
    if request.raw_input_contents and len(request.raw_input_contents) != 1:
        raise InvalidArgument(
            f"raw_input_contents has {len(request.raw_input_contents)} entries for 1 input"
        )
    raw = request.raw_input_contents[0] if request.raw_input_contents else None
    if tensor.datatype == "UINT8":
        return _pixels(tensor, raw)
    if tensor.datatype == "BYTES":
        return _encoded(tensor, raw)
    raise InvalidArgument(
        f"input '{INPUT_NAME}' has datatype {tensor.datatype or '(none)'}; "
        f"expected UINT8 (HWC pixels) or BYTES (a PNG or JPEG file)"
    )


def _pixels(tensor, raw: bytes | None) -> common_pb2.Image:
    shape = list(tensor.shape)
    if len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    if len(shape) != 3 or shape[0] < 1 or shape[1] < 1 or shape[2] not in _CHANNELS:
        raise InvalidArgument(
            f"input '{INPUT_NAME}' UINT8 shape must be [H, W, C] or [1, H, W, C] with H, W >= 1 "
            f"and C in 1, 3, 4; got {list(tensor.shape)}"
        )
    height, width, channels = shape
    num_bytes = height * width * channels
    if raw is None:
        values = tensor.contents.uint_contents
        if any(v > 255 for v in values):
            raise InvalidArgument(f"input '{INPUT_NAME}' UINT8 contents must be in 0..255")
        raw = bytes(values)
    if len(raw) != num_bytes:
        raise InvalidArgument(
            f"input '{INPUT_NAME}' has {len(raw)} bytes, expected {num_bytes} ({height}x{width}x{channels})"
        )
    return common_pb2.Image(raw=common_pb2.RawImage(pixels=raw, height=height, width=width, channels=channels))


def _encoded(tensor, raw: bytes | None) -> common_pb2.Image:
    if math.prod(tensor.shape) != 1:
        raise InvalidArgument(f"input '{INPUT_NAME}' BYTES must hold one encoded image, shape [1]; got {list(tensor.shape)}")
    if raw is None:
        if len(tensor.contents.bytes_contents) != 1:
            raise InvalidArgument(f"input '{INPUT_NAME}' BYTES contents must hold exactly one element")
        return common_pb2.Image(encoded=tensor.contents.bytes_contents[0])
    elements = unpack_bytes_tensor(raw)
    if len(elements) != 1:
        raise InvalidArgument(f"input '{INPUT_NAME}' BYTES raw contents hold {len(elements)} elements, expected 1")
    return common_pb2.Image(encoded=elements[0])


def requested_outputs(request: kserve.ModelInferRequest) -> tuple[RequestedOutput, ...]:
    if not request.outputs:
        return tuple(RequestedOutput(name) for name in OUTPUT_NAMES)
    wanted = []
    for output in request.outputs:
        if output.name not in OUTPUT_NAMES:
            raise InvalidArgument(f"unknown output '{output.name}'; this model has {', '.join(OUTPUT_NAMES)}")
        class_count = 0
        if "classification" in output.parameters:
            class_count = output.parameters["classification"].int64_param
            if class_count < 1:
                raise InvalidArgument(f"output '{output.name}': classification must be >= 1, got {class_count}")
        wanted.append(RequestedOutput(output.name, class_count))
    return tuple(wanted)


def scores_from_labels(labels: Sequence[str], ranked: Sequence[common_pb2.Label]) -> ClassScores:
    """Classify's top-k labels (k = every class) back into per-index order."""
    scores = [0.0] * len(labels)
    for label in ranked:
        if 0 <= label.index < len(scores):
            scores[label.index] = label.score
    return ClassScores(labels=tuple(labels), scores=tuple(scores))


def encode_outputs(
    response: kserve.ModelInferResponse, outputs: Sequence[RequestedOutput], classes: ClassScores
) -> None:
    num_classes = len(classes.labels)
    for output in outputs:
        tensor = response.outputs.add(name=output.name)
        if output.class_count:
            ranked = sorted(range(num_classes), key=lambda i: -classes.scores[i])[: output.class_count]
            entries = [f"{classes.scores[i]:f}:{i}:{classes.labels[i]}".encode() for i in ranked]
            tensor.datatype, tensor.shape[:] = "BYTES", [len(entries)]
            response.raw_output_contents.append(pack_bytes_tensor(entries))
        elif output.name == PROBABILITIES:
            tensor.datatype, tensor.shape[:] = "FP32", [num_classes]
            response.raw_output_contents.append(struct.pack(f"<{num_classes}f", *classes.scores))
        else:
            tensor.datatype, tensor.shape[:] = "BYTES", [num_classes]
            response.raw_output_contents.append(pack_bytes_tensor([label.encode() for label in classes.labels]))


def pack_bytes_tensor(elements: Sequence[bytes]) -> bytes:
    """Triton's raw BYTES layout: each element as a 4-byte little-endian length, then its bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def unpack_bytes_tensor(raw: bytes) -> list[bytes]:
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise InvalidArgument("BYTES tensor is truncated: a 4-byte length prefix is cut short")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidArgument(f"BYTES tensor is truncated: element of {length} bytes runs past the end")
        elements.append(raw[offset:offset + length])
        offset += length
    return elements


def model_metadata(name: str, versions: Sequence[str], num_classes: int) -> kserve.ModelMetadataResponse:
    tensor = kserve.ModelMetadataResponse.TensorMetadata
    return kserve.ModelMetadataResponse(
        name=name,
        versions=list(versions),
        platform="infermesh_classifier",
        inputs=[tensor(name=INPUT_NAME, datatype="UINT8", shape=[-1, -1, -1])],
        outputs=[
            tensor(name=PROBABILITIES, datatype="FP32", shape=[num_classes]),
            tensor(name=LABELS, datatype="BYTES", shape=[num_classes]),
        ],
    )
