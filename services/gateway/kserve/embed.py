"""Embedding models over KServe v2 ModelInfer (gRPC, and REST /infer): tensors <-> Generate with `embed`.

Contract (docs/clients.md), the generator's inputs (kserve/stream.py) with an embedding out:
  input   text_input  BYTES [1] (or [1, 1]): the UTF-8 text; or instead
          input_ids   INT32 or INT64 [n] (or [1, n]): its token ids (GenerateRequest.prompt_token_ids)
  params  dimensions (int): a Matryoshka model's shortened vectors (the OpenAI front's `dimensions`);
          those tritonclient or Triton's tools set on every request (priority, timeout, ...) are
          ignored; a generation parameter (max_tokens, temperature, logprobs, ...) is refused naming it,
          as is any other
  output  embedding   FP32 [d]: the pooled vector (normalized where the model normalizes), d its
          dimensions or the `dimensions` asked for; the response's parameter prompt_tokens counts the
          prompt's tokens
One text per request, as a generator's text_input is one prompt; the scheduler batches the sequences of
concurrent requests into the same steps.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument
from services.gateway.kserve.codec import requested_among
from services.gateway.kserve.models import EMBEDDING_OUTPUT, TOKEN_INPUT
from services.gateway.kserve.stream import GENERATION_PARAMETERS, TRANSPORT_PARAMETERS, set_prompt

DIMENSIONS = "dimensions"


@dataclass(frozen=True)
class EmbedRequest:
    generate: gateway_pb2.GenerateRequest
    # Triton's id for the request, echoed in the response ("" when the client sent none).
    id: str


def parse_embed_request(request: kserve.ModelInferRequest, model: gateway_pb2.ModelInfo,
                        request_id: str) -> EmbedRequest:
    """The request checked against an embedding model; every refusal names the input, parameter or output."""
    generate = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=request.model_name, version=request.model_version),
        request_id=request_id)
    generate.embed.SetInParent()
    for key, parameter in request.parameters.items():
        if key == DIMENSIONS:
            generate.embed.dimensions = _dimensions(parameter)
        elif key in GENERATION_PARAMETERS:
            raise InvalidArgument(f"parameter '{key}' is a generation parameter; model {model.model.name}:"
                                  f"{model.model.version} is an embedding model (it takes {DIMENSIONS})")
        elif key not in TRANSPORT_PARAMETERS:
            raise InvalidArgument(f"unknown parameter '{key}'; an embedding model takes {DIMENSIONS}")
    set_prompt(generate, request)
    for output in requested_among(request, (EMBEDDING_OUTPUT,), f"an embedding model has '{EMBEDDING_OUTPUT}'"):
        if output.class_count:
            raise InvalidArgument(f"output '{EMBEDDING_OUTPUT}': classification applies to a classifier's outputs")
    return EmbedRequest(generate, request.id)


def _dimensions(parameter: kserve.InferParameter) -> int:
    kind = parameter.WhichOneof("parameter_choice")
    value = getattr(parameter, kind) if kind in ("int64_param", "uint64_param") else None
    if value is None or not 1 <= value < 2**32:
        shown = "nothing" if kind is None else repr(getattr(parameter, kind))
        raise InvalidArgument(f"parameter '{DIMENSIONS}' must be an integer >= 1, got {shown}")
    return value


def embed_response(request: EmbedRequest, last: gateway_pb2.GenerateResponse) -> kserve.ModelInferResponse:
    """The embedding as one FP32 tensor [d], and the prompt's token count."""
    response = kserve.ModelInferResponse(model_name=last.model.name or request.generate.model.name,
                                         model_version=last.model.version, id=request.id)
    vector = list(last.embedding)
    response.outputs.add(name=EMBEDDING_OUTPUT, datatype="FP32", shape=[len(vector)])
    response.raw_output_contents.append(struct.pack(f"<{len(vector)}f", *vector))
    response.parameters["prompt_tokens"].int64_param = last.usage.prompt_tokens
    return response


def named_refusal(request: EmbedRequest, err: InvalidArgument) -> InvalidArgument:
    """The scheduler's refusal in the request's terms: `dimensions` for embed.dimensions, the input that
    held a token id past the model's vocabulary."""
    if err.message.startswith("embed.dimensions"):
        return InvalidArgument(f"parameter '{DIMENSIONS}'" + err.message.removeprefix("embed.dimensions"))
    if request.generate.prompt_token_ids and err.message.startswith("prompt_token_ids["):
        return InvalidArgument(f"input '{TOKEN_INPUT}'" + err.message.removeprefix("prompt_token_ids"))
    return err
