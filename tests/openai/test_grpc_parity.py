"""The gRPC Generate and the HTTP front run one core: the same request is treated the same on both."""

from __future__ import annotations

import json

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.openai.conftest import KEYS, MODEL
from tests.openai.test_http_contract import _error, _HeldStream
from tools.testbed import session_tls
from tools.testbed.scheduler_fixtures import toy_continuation

pytestmark = pytest.mark.integration

BODY = {"model": MODEL, "prompt": "a", "max_tokens": 1}


def _grpc_status(http_mesh, key: str, priority: str | None = None) -> tuple[grpc.StatusCode, str]:
    metadata = [("authorization", f"Bearer {key}")] + ([("x-infermesh-priority", priority)] if priority else [])
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL), prompt="a",
                                          sampling=common_pb2.SamplingParams(max_tokens=1))
    with session_tls.channel(http_mesh.mesh.gateway.address) as channel:
        try:
            list(gateway_pb2_grpc.InferenceStub(channel).Generate(request, timeout=10, metadata=metadata))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_the_priority_key_lowers_a_class_on_both_paths_and_never_raises_one(http_mesh):
    held = _HeldStream(http_mesh)
    try:
        # One request in flight: sheddable traffic is shed, standard is served.
        assert _grpc_status(http_mesh, KEYS["alpha"])[0] == grpc.StatusCode.OK
        code, details = _grpc_status(http_mesh, KEYS["alpha"], "sheddable")
        status, error = _error(http_mesh.post("/completions", BODY, headers={"x-infermesh-priority": "sheddable"}))
        assert (code, status) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 503)
        assert details.split(";")[0] == error["message"].split(";")[0]
        # A sheddable tenant asking for critical stays sheddable.
        assert _grpc_status(http_mesh, KEYS["cheap"], "critical")[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _error(http_mesh.post("/completions", BODY, key=KEYS["cheap"],
                                     headers={"x-infermesh-priority": "critical"}))[0] == 503
    finally:
        held.close()
    http_mesh.wait_idle()


def test_a_bad_priority_gets_the_same_message_on_both_paths(http_mesh):
    code, details = _grpc_status(http_mesh, KEYS["alpha"], "urgent")
    status, error = _error(http_mesh.post("/completions", BODY, headers={"x-infermesh-priority": "urgent"}))
    assert (code, status, details) == (grpc.StatusCode.INVALID_ARGUMENT, 400, error["message"])


def test_chat_as_grpc_messages_answers_what_http_chat_answers(http_mesh):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "abc"}]
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=MODEL),
                                          messages=[gateway_pb2.ChatMessage(**m) for m in messages],
                                          sampling=common_pb2.SamplingParams(max_tokens=5))
    with session_tls.channel(http_mesh.mesh.gateway.address) as channel:
        chunks = list(gateway_pb2_grpc.InferenceStub(channel).Generate(
            request, timeout=10, metadata=[("authorization", f"Bearer {KEYS['alpha']}")]))
    status, _, body = http_mesh.post("/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 5,
                                                           "temperature": 0})
    assert status == 200, body
    reply = json.loads(body)
    rendered = "system: Be brief.\nuser: abc\nassistant:"
    assert "".join(c.text for c in chunks) == reply["choices"][0]["message"]["content"] == toy_continuation(rendered, 5)
    assert chunks[-1].usage.prompt_tokens == reply["usage"]["prompt_tokens"] == len(rendered)
