"""Bad input at the gateway gets the right status and message, and no process dies."""

from __future__ import annotations

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from tools.testbed.processes import SERVING, health_status

pytestmark = pytest.mark.integration


def _raw(height: int, width: int, channels: int = 3, num_bytes: int | None = None) -> common_pb2.Image:
    size = height * width * channels if num_bytes is None else num_bytes
    return common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(size), height=height, width=width, channels=channels))


def _classify(stub, **fields):
    return stub.Classify(gateway_pb2.ClassifyRequest(**fields), timeout=10)


def _status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


CLASSIFIER = common_pb2.ModelRef(name="toy-classifier")
GENERATOR = common_pb2.ModelRef(name="toy-generator")


@pytest.mark.parametrize(
    ("fields", "code", "message"),
    [
        ({"model": common_pb2.ModelRef(name="nope"), "image": _raw(2, 2)}, grpc.StatusCode.NOT_FOUND,
         "model 'nope' is not served here"),
        ({"model": common_pb2.ModelRef(name="toy-classifier", version="9"), "image": _raw(2, 2)},
         grpc.StatusCode.NOT_FOUND, "model 'toy-classifier:9' is not served here"),
        ({"image": _raw(2, 2)}, grpc.StatusCode.INVALID_ARGUMENT, "model.name is required"),
        ({"model": CLASSIFIER}, grpc.StatusCode.INVALID_ARGUMENT, "image is required (encoded bytes or raw pixels)"),
        ({"model": GENERATOR, "image": _raw(2, 2)}, grpc.StatusCode.INVALID_ARGUMENT,
         "model toy-generator:1 is a MODEL_KIND_GENERATOR and cannot serve Classify"),
        ({"model": CLASSIFIER, "image": _raw(2, 2, num_bytes=5)}, grpc.StatusCode.INVALID_ARGUMENT,
         "raw image has 5 bytes; 2x2x3 needs 12"),
        ({"model": CLASSIFIER, "image": common_pb2.Image(encoded=b"not an image")}, grpc.StatusCode.INVALID_ARGUMENT,
         "image bytes are not a PNG or JPEG file (12 bytes)"),
        ({"model": CLASSIFIER, "image": _raw(2, 2), "top_k": 5}, grpc.StatusCode.INVALID_ARGUMENT,
         "top_k 5 exceeds the 2 classes of toy-classifier:1"),
    ],
)
def test_classify_rejects_bad_input_with_precise_status(gateway_stub, fields, code, message):
    got_code, got_message = _status_of(lambda: _classify(gateway_stub, **fields))
    assert got_code == code
    assert got_message.startswith(message)


def test_an_error_about_a_huge_model_name_keeps_its_own_status(gateway_stub):
    # The message names the model; uncut, it overflowed the client's 16 KiB trailer limit and the
    # caller saw RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead.
    name = "m" * 17_000
    got_code, got_message = _status_of(lambda: _classify(gateway_stub, model=common_pb2.ModelRef(name=name),
                                                         image=_raw(2, 2)))
    assert got_code != grpc.StatusCode.RESOURCE_EXHAUSTED, got_message
    assert got_code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED), got_message
    assert got_message.endswith("more characters)")


def test_oversized_message_is_resource_exhausted(gateway_stub):
    got_code, got_message = _status_of(lambda: _classify(gateway_stub, model=CLASSIFIER, image=_raw(400, 400)))
    assert got_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in got_message.lower() or "message" in got_message.lower()


@pytest.mark.parametrize(
    ("request_fields", "code", "message"),
    [
        ({"model": GENERATOR, "prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"),
        ({"model": CLASSIFIER, "prompt": "hi"}, grpc.StatusCode.INVALID_ARGUMENT,
         "model toy-classifier:1 is a MODEL_KIND_CLASSIFIER and cannot serve Generate"),
        ({"model": GENERATOR, "prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=-1)},
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature must be a finite number >= 0, got -1.0"),
        ({"model": GENERATOR, "prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=float("nan"))},
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature must be a finite number >= 0, got nan"),
        ({"model": GENERATOR, "prompt": "hi", "sampling": common_pb2.SamplingParams(temperature=float("inf"))},
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature must be a finite number >= 0, got inf"),
        ({"model": GENERATOR, "prompt": "hi", "sampling": common_pb2.SamplingParams(stop=[f"s{i}" for i in range(17)])},
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop holds 17 strings; at most 16 are allowed"),
        ({"model": GENERATOR, "prompt": "hi", "sampling": common_pb2.SamplingParams(stop=["é" * 129])},
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop strings must be at most 256 bytes (UTF-8), got one of 258"),
        ({"model": GENERATOR, "prompt": "hi", "sampling": common_pb2.SamplingParams(max_tokens=100_000)},
         grpc.StatusCode.INVALID_ARGUMENT, "prompt of 2 tokens plus max_tokens 100000 exceeds"),
        ({"model": GENERATOR, "prompt": "a" * 100_000}, grpc.StatusCode.INVALID_ARGUMENT,
         "prompt of 100000 tokens does not fit the model's context of 512 tokens (prompt and output together)"),
        ({"model": GENERATOR, "prompt": "hi", "messages": [gateway_pb2.ChatMessage(role="user", content="hi")]},
         grpc.StatusCode.INVALID_ARGUMENT, "set prompt or messages, not both"),
        ({"model": GENERATOR, "messages": [gateway_pb2.ChatMessage(role="user", content="hi"),
                                           gateway_pb2.ChatMessage(role="robot", content="{}")]},
         grpc.StatusCode.INVALID_ARGUMENT,
         "messages[1].role must be one of system, developer, user, assistant, tool, got 'robot'"),
        ({"model": GENERATOR, "prompt": "hi", "tools": [gateway_pb2.Tool(name="f")]},
         grpc.StatusCode.INVALID_ARGUMENT, "tools need messages (a conversation), not a prompt"),
        ({"model": GENERATOR, "prompt": "hi", "prompt_token_ids": [104, 105]},
         grpc.StatusCode.INVALID_ARGUMENT, "set prompt_token_ids or prompt, not both"),
        ({"model": GENERATOR, "prompt_token_ids": [104], "messages": [gateway_pb2.ChatMessage(role="user", content="hi")]},
         grpc.StatusCode.INVALID_ARGUMENT, "set prompt_token_ids or messages, not both"),
        ({"model": GENERATOR, "prompt_token_ids": [104], "tools": [gateway_pb2.Tool(name="f")]},
         grpc.StatusCode.INVALID_ARGUMENT, "tools need messages (a conversation), not a prompt"),
        ({"model": GENERATOR, "prompt_token_ids": [104, 100_000]},
         grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids[1] is 100000, but the model's token ids are 0.."),
        ({"model": GENERATOR, "prompt_token_ids": [104] * 600}, grpc.StatusCode.INVALID_ARGUMENT,
         "prompt of 600 tokens does not fit the model's context of 512 tokens (prompt and output together)"),
        ({"model": GENERATOR, "messages": [gateway_pb2.ChatMessage(role="user", content="hi")],
          "tools": [gateway_pb2.Tool(name="f", parameters="[1]")]},
         grpc.StatusCode.INVALID_ARGUMENT, "tools[0].parameters must be a JSON schema (an object, as JSON text)"),
    ],
)
def test_generate_rejects_bad_input_with_precise_status(gateway_stub, request_fields, code, message):
    def call():
        return list(gateway_stub.Generate(gateway_pb2.GenerateRequest(**request_fields), timeout=10))

    got_code, got_message = _status_of(call)
    assert got_code == code
    assert got_message.startswith(message)


def test_tokenize_and_detokenize_answer_with_the_models_tokenizer(gateway_stub):
    reply = gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(model=GENERATOR, prompt="abc"), timeout=10)
    assert (list(reply.token_ids), list(reply.token_bytes)) == ([97, 98, 99], [b"a", b"b", b"c"])
    assert (reply.model.name, reply.model.version, reply.max_seq_len) == ("toy-generator", "1", 512)
    text = gateway_stub.Detokenize(gateway_pb2.DetokenizeRequest(model=GENERATOR, token_ids=[104, 0xC3, 0xA9]),
                                   timeout=10)
    assert (text.text, text.model.version) == ("hé", "1")
    # No model named: the caller's only generator (the toy mesh serves one), as vLLM's single model.
    unnamed = gateway_stub.Tokenize(gateway_pb2.TokenizeRequest(prompt="abc"), timeout=10)
    assert (list(unnamed.token_ids), unnamed.model.name) == ([97, 98, 99], "toy-generator")


@pytest.mark.parametrize(("call", "request_fields", "code", "message"), [
    ("Tokenize", {"model": GENERATOR}, grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty"),
    ("Tokenize", {"model": common_pb2.ModelRef(name="nope"), "prompt": "a"}, grpc.StatusCode.NOT_FOUND,
     "model 'nope' is not served here"),
    ("Tokenize", {"model": GENERATOR, "prompt": "a", "tools": [gateway_pb2.Tool(name="f")]},
     grpc.StatusCode.INVALID_ARGUMENT, "tools need messages (a conversation), not a prompt"),
    ("Tokenize", {"model": CLASSIFIER, "prompt": "a"}, grpc.StatusCode.INVALID_ARGUMENT,
     "model toy-classifier:1 is a MODEL_KIND_CLASSIFIER"),
    ("Detokenize", {"model": GENERATOR, "token_ids": [1, 100_000]}, grpc.StatusCode.INVALID_ARGUMENT,
     "token_ids[1] is 100000, but the model's token ids are 0.."),
])
def test_tokenize_and_detokenize_refuse_bad_input_with_precise_status(gateway_stub, call, request_fields, code,
                                                                      message):
    kind = gateway_pb2.TokenizeRequest if call == "Tokenize" else gateway_pb2.DetokenizeRequest
    got_code, got_message = _status_of(lambda: getattr(gateway_stub, call)(kind(**request_fields), timeout=10))
    assert (got_code, got_message[:len(message)]) == (code, message)


def test_no_process_died_after_bad_input(toy_mesh, gateway_stub):
    _status_of(lambda: _classify(gateway_stub, model=CLASSIFIER, image=common_pb2.Image(encoded=b"\x89PNG garbage")))
    for process in toy_mesh.processes:
        assert process.alive(), f"{process.name} died:\n{process.log_tail()}"
        if process.service != "worker":
            assert health_status(process.address) == SERVING
    reply = _classify(gateway_stub, model=CLASSIFIER, image=_raw(2, 2))
    assert reply.labels[0].label == "dark"
