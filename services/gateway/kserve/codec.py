"""KServe v2 tensors <-> infermesh classify: the input image and the output tensors.

Contract (docs/clients.md):
  input  IMAGE  UINT8  [N, H, W, C], C in 1, 3, 4: N images of raw pixels, row-major HWC
                       (metadata: [-1, H, W, 3] with the model's trained size; any H, W is resized)
         IMAGE  UINT8  [H, W, C]: one image, outputs without the batch dimension (older clients)
         IMAGE  BYTES  [N, 1]: N PNG or JPEG files; [1] or [N]: as many, outputs unbatched for [1]
  output PROBABILITIES  FP32  [N, num_classes]: softmax score per class index
         LABELS         BYTES [N, num_classes]: class names, same order
  An output requested with the classification extension (parameter
  `classification: k`, tritonclient's `class_count=k`) is instead BYTES [N, k]
  of "score:index:label", most probable first, as Triton writes it. An input
  without a batch dimension gets outputs without one ([num_classes], [k]).
Data comes from `raw_input_contents` (as tritonclient sends it) or from typed
`contents` (uint_contents / bytes_contents); outputs go out as
`raw_output_contents`, in the order of `outputs`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
class DecodedImages:
    images: tuple[common_pb2.Image, ...]
    # The input had a leading batch dimension, so the outputs get one too.
    batched: bool


@dataclass(frozen=True)
class ClassScores:
    """Every class's score, by class index; labels in the same order."""

    labels: tuple[str, ...]
    scores: tuple[float, ...]


# The typed contents field each accepted datatype's values travel in (KServe v2 / Triton).
_CONTENTS_FIELD = {"UINT8": "uint_contents", "BYTES": "bytes_contents"}


def decode_images(request: kserve.ModelInferRequest) -> DecodedImages:
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
    typed = [field.name for field, _ in tensor.contents.ListFields()]
    if raw is not None and typed:  # Triton refuses this too: which of the two is the input?
        raise InvalidArgument(f"input '{INPUT_NAME}' has both raw_input_contents and contents.{typed[0]}; send one")
    expected = _CONTENTS_FIELD.get(tensor.datatype)
    if raw is None and expected is not None and any(name != expected for name in typed):
        raise InvalidArgument(f"input '{INPUT_NAME}' is {tensor.datatype}: its values go in contents.{expected}, "
                              f"got contents.{next(name for name in typed if name != expected)}")
    if tensor.datatype == "UINT8":
        return _pixels(tensor, raw)
    if tensor.datatype == "BYTES":
        return _encoded(tensor, raw)
    raise InvalidArgument(
        f"input '{INPUT_NAME}' has datatype {tensor.datatype or '(none)'}; "
        f"expected UINT8 (HWC pixels) or BYTES (a PNG or JPEG file)"
    )


def _pixels(tensor, raw: bytes | None) -> DecodedImages:
    shape = list(tensor.shape)
    batched = len(shape) == 4
    batch_shape = shape if batched else [1, *shape]
    if (len(batch_shape) != 4 or batch_shape[0] < 1 or batch_shape[1] < 1 or batch_shape[2] < 1
            or batch_shape[3] not in _CHANNELS):
        raise InvalidArgument(
            f"input '{INPUT_NAME}' UINT8 shape must be [N, H, W, C] or [H, W, C] with N, H, W >= 1 "
            f"and C in 1, 3, 4; got {list(tensor.shape)}"
        )
    num_images, height, width, channels = batch_shape
    num_bytes = num_images * height * width * channels
    if raw is None:
        values = tensor.contents.uint_contents
        if any(v > 255 for v in values):
            raise InvalidArgument(f"input '{INPUT_NAME}' UINT8 contents must be in 0..255")
        raw = bytes(values)
    if len(raw) != num_bytes:
        shown = "x".join(str(d) for d in (shape if batched and num_images > 1 else batch_shape[1:]))
        raise InvalidArgument(f"input '{INPUT_NAME}' has {len(raw)} bytes, expected {num_bytes} ({shown})")
    size = height * width * channels
    images = tuple(
        common_pb2.Image(raw=common_pb2.RawImage(pixels=raw[i * size:(i + 1) * size], height=height, width=width,
                                                 channels=channels))
        for i in range(num_images)
    )
    return DecodedImages(images, batched)


def _encoded(tensor, raw: bytes | None) -> DecodedImages:
    shape = list(tensor.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
        raise InvalidArgument(
            f"input '{INPUT_NAME}' BYTES must hold one encoded image per batch entry, shape [N] or [N, 1]; "
            f"got {shape}")
    num_images = shape[0]
    if raw is None:
        elements = list(tensor.contents.bytes_contents)
        what = "contents"
    else:
        elements = unpack_bytes_tensor(raw)
        what = "raw contents"
    if len(elements) != num_images:
        raise InvalidArgument(
            f"input '{INPUT_NAME}' BYTES {what} hold {len(elements)} elements, expected {num_images} (shape {shape})")
    return DecodedImages(tuple(common_pb2.Image(encoded=e) for e in elements), len(shape) == 2 or num_images > 1)


def requested_outputs(request: kserve.ModelInferRequest) -> tuple[RequestedOutput, ...]:
    return requested_among(request, OUTPUT_NAMES, f"this model has {', '.join(OUTPUT_NAMES)}")


def requested_among(request: kserve.ModelInferRequest, names: Sequence[str], has: str) -> tuple[RequestedOutput, ...]:
    """The outputs `request` asks for, each with its classification k (every one of `names` when it
    names none): the one reading of ModelInferRequest.outputs for image and tensor models. `has`
    ends the refusal of a name not in `names` ("this model has ...")."""
    if not request.outputs:
        return tuple(RequestedOutput(name) for name in names)
    wanted = []
    for output in request.outputs:
        if output.name not in names:
            raise InvalidArgument(f"unknown output '{output.name}'; {has}")
        class_count = 0
        if "classification" in output.parameters:
            class_count = class_count_of(output.name, output.parameters["classification"])
        wanted.append(RequestedOutput(output.name, class_count))
    return tuple(wanted)


def class_count(value: object, field: str, shown: str) -> int:
    """The classification extension's class count k, an integer >= 1: the one rule of it for both
    KServe transports. gRPC passes an int64 or uint64 parameter's value (class_count_of), REST the
    JSON value before it becomes a parameter (kserve_http_codec), each naming the field and showing
    the value in its own terms."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{field} must be an integer >= 1, got {shown}")
    return value


def class_count_of(output_name: str, parameter: kserve.InferParameter) -> int:
    """The classification parameter's k (int64_param, as tritonclient sends it, or uint64)."""
    kind = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, kind) if kind in ("int64_param", "uint64_param") else None
    shown = "nothing" if kind is None else f"{kind} {getattr(parameter, kind)!r}"
    return class_count(value, f"output '{output_name}': classification", shown)


def scores_from_labels(labels: Sequence[str], ranked: Sequence[common_pb2.Label]) -> ClassScores:
    """Classify's top-k labels (k = every class) back into per-index order."""
    scores = [0.0] * len(labels)
    for label in ranked:
        if 0 <= label.index < len(scores):
            scores[label.index] = label.score
    return ClassScores(labels=tuple(labels), scores=tuple(scores))


def encode_outputs(response: kserve.ModelInferResponse, outputs: Sequence[RequestedOutput],
                   batch: Sequence[ClassScores], batched: bool) -> None:
    """One tensor per requested output, each image's row in batch order ([N, ...], or [...] unbatched)."""
    for output in outputs:
        tensor = response.outputs.add(name=output.name)
        rows: Sequence[Sequence[Any]]  # each image's entries: encoded top-k, scores or label names
        if output.class_count:
            rows = [_top_entries(scores, output.class_count) for scores in batch]
            tensor.datatype = "BYTES"
            raw = pack_bytes_tensor([entry for row in rows for entry in row])
        elif output.name == PROBABILITIES:
            rows = [scores.scores for scores in batch]
            tensor.datatype = "FP32"
            values = [value for row in rows for value in row]
            raw = struct.pack(f"<{len(values)}f", *values)
        else:
            rows = [scores.labels for scores in batch]
            tensor.datatype = "BYTES"
            raw = pack_bytes_tensor([label.encode() for row in rows for label in row])
        width = len(rows[0]) if rows else 0
        tensor.shape[:] = [len(rows), width] if batched else [width]
        response.raw_output_contents.append(raw)


def _top_entries(classes: ClassScores, class_count: int) -> list[bytes]:
    ranked = sorted(range(len(classes.labels)), key=lambda i: -classes.scores[i])[:class_count]
    return [f"{classes.scores[i]:f}:{i}:{classes.labels[i]}".encode() for i in ranked]


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


