"""atheris: a KServe v2 ModelInfer request as the gateway reads it (services/gateway/kserve/codec.py):
wire bytes -> ModelInferRequest -> the input image and the requested outputs."""

from __future__ import annotations

import atheris
from google.protobuf.message import DecodeError

from fuzz.harness import fuzz

with atheris.instrument_imports(include=["services.gateway.kserve.codec"]):
    from inference import grpc_predict_v2_pb2 as kserve
    from services.common.errors import InvalidArgument
    from services.gateway.kserve.codec import decode_image, requested_outputs, unpack_bytes_tensor


def check(data: bytes) -> None:
    try:
        request = kserve.ModelInferRequest.FromString(data)
    except DecodeError:
        return  # grpc answers INVALID_ARGUMENT (services/common/request_decoding.py)
    for step in (decode_image, requested_outputs):
        try:
            step(request)
        except InvalidArgument:
            pass
    for raw in request.raw_input_contents:
        try:
            unpack_bytes_tensor(raw)
        except InvalidArgument:
            pass


if __name__ == "__main__":
    fuzz(check)
