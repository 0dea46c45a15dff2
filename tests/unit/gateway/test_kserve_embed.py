"""Embedding models over KServe v2: metadata and config list the `embedding` output, a ModelInfer request
becomes a Generate with `embed`, generation parameters and other refusals name what was sent, and the
response carries the vector as FP32 [d]."""

from __future__ import annotations

import struct

import pytest

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument
from services.gateway.kserve import embed as kserve_embed
from services.gateway.kserve import models as kserve_models
from services.gateway.kserve.codec import pack_bytes_tensor

EMBEDDER = gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="emb", version="1"),
                                 kind=common_pb2.MODEL_KIND_GENERATOR, ready=True, max_seq_len=256,
                                 embedding_dimensions=64)


def _request(text: str = "hello", **parameters) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="emb", id="r1")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(pack_bytes_tensor([text.encode()]))
    for key, value in parameters.items():
        if isinstance(value, bool):
            request.parameters[key].bool_param = value
        elif isinstance(value, int):
            request.parameters[key].int64_param = value
        elif isinstance(value, float):
            request.parameters[key].double_param = value
        else:
            request.parameters[key].string_param = value
    return request


def test_metadata_and_config_list_the_embedding_output_and_no_decoupling():
    meta = kserve_models.model_metadata(EMBEDDER, ["1"])
    assert meta.platform == kserve_models.EMBEDDING_PLATFORM
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("text_input", "BYTES", [1]),
                                                                          ("input_ids", "INT32", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("embedding", "FP32", [64])]
    config = kserve_models.model_config(EMBEDDER)
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [("embedding", kserve.TYPE_FP32, [64])]
    assert (config.max_batch_size, config.model_transaction_policy.decoupled) == (0, False)
    assert config.parameters["max_seq_len"].string_value == "256"
    generator = gateway_pb2.ModelInfo(model=EMBEDDER.model, kind=common_pb2.MODEL_KIND_GENERATOR)
    assert not kserve_models.is_embedding(generator) and kserve_models.is_embedding(EMBEDDER)


def test_a_text_input_becomes_an_embed_request_with_its_dimensions():
    parsed = kserve_embed.parse_embed_request(_request("hi there", dimensions=8, priority=1, timeout=5), EMBEDDER, "r1")
    generate = parsed.generate
    assert (generate.prompt, generate.HasField("embed"), generate.embed.dimensions) == ("hi there", True, 8)
    assert (generate.model.name, generate.request_id, parsed.id) == ("emb", "r1", "r1")
    plain = kserve_embed.parse_embed_request(_request(), EMBEDDER, "r2").generate
    assert plain.HasField("embed") and not plain.embed.HasField("dimensions")


def test_token_ids_are_an_input_too():
    request = kserve.ModelInferRequest(model_name="emb")
    request.inputs.add(name="input_ids", datatype="INT32", shape=[3]).contents.int_contents.extend([5, 6, 7])
    assert list(kserve_embed.parse_embed_request(request, EMBEDDER, "r").generate.prompt_token_ids) == [5, 6, 7]


@pytest.mark.parametrize(("parameters", "says"), [
    ({"max_tokens": 5}, "parameter 'max_tokens' is a generation parameter; model emb:1 is an embedding model"),
    ({"temperature": 0.5}, "parameter 'temperature' is a generation parameter"),
    ({"logprobs": True}, "parameter 'logprobs' is a generation parameter"),
    ({"ttft_ms": 100}, "parameter 'ttft_ms' is a generation parameter"),
    ({"frobnicate": 1}, "unknown parameter 'frobnicate'; an embedding model takes dimensions"),
    ({"dimensions": 0}, "parameter 'dimensions' must be an integer >= 1, got 0"),
    ({"dimensions": "8"}, "parameter 'dimensions' must be an integer >= 1, got '8'"),
    ({"dimensions": 2.0}, "parameter 'dimensions' must be an integer >= 1, got 2.0"),
])
def test_refusals_name_the_parameter(parameters, says):
    with pytest.raises(InvalidArgument) as caught:
        kserve_embed.parse_embed_request(_request(**parameters), EMBEDDER, "r")
    assert says in caught.value.message


def test_refusals_name_the_input_and_the_output():
    request = _request()
    request.inputs[0].shape[:] = [2]
    with pytest.raises(InvalidArgument, match="input 'text_input' must be BYTES of shape"):
        kserve_embed.parse_embed_request(request, EMBEDDER, "r")
    request = _request()
    request.outputs.add(name="text_output")
    with pytest.raises(InvalidArgument, match="unknown output 'text_output'; an embedding model has 'embedding'"):
        kserve_embed.parse_embed_request(request, EMBEDDER, "r")
    request = _request()
    request.outputs.add(name="embedding").parameters["classification"].int64_param = 2
    with pytest.raises(InvalidArgument, match="output 'embedding': classification applies to a classifier"):
        kserve_embed.parse_embed_request(request, EMBEDDER, "r")


def test_the_response_is_the_vector_as_fp32_and_the_prompts_token_count():
    parsed = kserve_embed.parse_embed_request(_request(), EMBEDDER, "r1")
    last = gateway_pb2.GenerateResponse(model=EMBEDDER.model, embedding=[0.5, -0.25, 1.0],
                                        usage=common_pb2.Usage(prompt_tokens=4))
    response = kserve_embed.embed_response(parsed, last)
    (output,) = response.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("embedding", "FP32", [3])
    assert struct.unpack("<3f", response.raw_output_contents[0]) == (0.5, -0.25, 1.0)
    assert (response.id, response.model_version, response.parameters["prompt_tokens"].int64_param) == ("r1", "1", 4)


def test_the_schedulers_refusals_are_renamed_to_what_the_request_sent():
    parsed = kserve_embed.parse_embed_request(_request(dimensions=8), EMBEDDER, "r")
    renamed = kserve_embed.named_refusal(parsed, InvalidArgument("embed.dimensions must be in [1, 64] (the "
                                                                 "model's dimensions), got 80"))
    assert renamed.message.startswith("parameter 'dimensions' must be in [1, 64]")
