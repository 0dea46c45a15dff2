"""KServe v2 tensors for the load test's payloads, shared by the gRPC and REST kinds. Pure: no I/O.

The classifier contract is the one our gateway serves (docs/clients.md), Triton's layout:
  IMAGE  BYTES [1, 1]        one PNG file (binary: 4-byte little-endian length, then the bytes)
  IMAGE  UINT8 [1, H, W, C]  raw pixels, row-major HWC
The generator contract is Triton's vLLM backend's: `text_input` BYTES [1] plus sampling
parameters; one `text_output` BYTES [1] per streamed chunk.
A tensor class sends its own inputs (loadtest/payloads.py makes them), each in the raw layout.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from loadtest.payloads import ImagePayload, TensorPayload
from loadtest.scenario import ImageEncoding

IMAGE_INPUT = "IMAGE"
TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
FINAL = "triton_final_response"


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes  # the binary form (raw_input_contents / the REST binary extension)


def image_tensor(payload: ImagePayload) -> Tensor:
    if payload.encoding is ImageEncoding.PNG:
        return Tensor(IMAGE_INPUT, "BYTES", (1, 1), pack_bytes([payload.data]))
    return Tensor(IMAGE_INPUT, "UINT8", (1, payload.height, payload.width, payload.channels), payload.data)


def request_tensors(payload: ImagePayload | TensorPayload) -> tuple[Tensor, ...]:
    """The inputs of a ModelInfer request: the image, or a tensor class's own inputs in order."""
    if isinstance(payload, ImagePayload):
        return (image_tensor(payload),)
    return tuple(Tensor(t.name, t.datatype, t.shape, t.raw) for t in payload.inputs)


def text_tensor(prompt: str) -> Tensor:
    return Tensor(TEXT_INPUT, "BYTES", (1,), pack_bytes([prompt.encode("utf-8")]))


def pack_bytes(elements: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def unpack_bytes(raw: bytes) -> list[bytes]:
    """Raises ValueError when a length runs past the end."""
    elements, offset = [], 0
    while offset < len(raw):
        if offset + 4 > len(raw):
            raise ValueError(f"a BYTES tensor ends inside a length prefix at byte {offset}")
        (size,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + size > len(raw):
            raise ValueError(f"a BYTES element of {size} bytes runs past the tensor's end")
        elements.append(raw[offset:offset + size])
        offset += size
    return elements
