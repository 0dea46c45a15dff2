"""The gRPC Generate and the HTTP front run one core: the same request is treated the same on both."""

from __future__ import annotations

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.openai.conftest import KEYS, MODEL
from tests.openai.test_http_contract import _error, _HeldStream
from tools.testbed import session_tls

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
