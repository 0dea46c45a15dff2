"""The routing file is re-read when it changes: a good file takes effect without a restart, a bad
one is refused (logged, counted) and the routing in force stays; requests are counted under the
version that served them. A version without endpoints goes to the discovered scheduler."""

from __future__ import annotations

import os

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed.gateway_fixtures import BRIGHT, scrape, status_of
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

# Version 1 of toy-classifier on the schedulers the gateway discovers (no endpoints listed).
DISCOVERED = 'models:\n  toy-classifier:\n    default_version: "1"\n'
# The same, and a canary at 100 % that no scheduler serves: version-less calls stay on 1.
UNSERVED_CANARY = DISCOVERED + '    versions:\n      "2": {canary_percent: 100}\n'
ELSEWHERE = 'models:\n  toy-generator:\n    default_version: "1"\n'


def _replace(path, text: str) -> None:
    """Write beside the file and rename over it, as a ConfigMap volume swaps its files."""
    staged = path.with_suffix(".new")
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, path)


def _channel(process) -> grpc.Channel:
    # TLS-by-default meshes give processes a channel(); a plaintext mesh has none.
    return process.channel() if hasattr(process, "channel") else grpc.insecure_channel(process.address)


def test_routing_file_reloads_on_change_and_refuses_a_bad_one(tmp_path):
    routing = tmp_path / "routing.yaml"
    routing.write_text(DISCOVERED, encoding="utf-8")
    metrics_port = free_port()
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        gateway = mesh.start_gateway("--routing-file", str(routing), "--tenants-poll-interval-ms", "100",
                                     "--metrics-port", str(metrics_port))

        def reloads(result: str) -> float:
            return scrape(metrics_port).value("infermesh_gateway_config_reloads_total", file="routing", result=result)

        def classify():
            return stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="toy-classifier"),
                                                             image=BRIGHT), timeout=10)

        with _channel(gateway) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            assert classify().model.version == "1"

            _replace(routing, UNSERVED_CANARY)
            wait_until(lambda: reloads("applied") == 1, timeout_s=10, message="routing reload applied")
            assert "routing file reloaded" in gateway.log_tail(50)
            assert classify().model.version == "1", "a canary no scheduler serves falls back to the default"

            _replace(routing, "models:\n  toy-classifier: {}\n")
            wait_until(lambda: reloads("refused") == 1, timeout_s=10, message="bad routing file refused")
            refusal = next(line for line in gateway.log_tail(50).splitlines() if "refused routing file" in line)
            assert f"{routing}: model 'toy-classifier': field 'default_version': is required" in refusal
            assert classify().model.version == "1", "the routing in force stays"

            _replace(routing, ELSEWHERE)
            wait_until(lambda: reloads("applied") == 2, timeout_s=10, message="second routing reload")
            got = status_of(classify)
            assert (got.code, got.message) == (grpc.StatusCode.NOT_FOUND, "unknown model 'toy-classifier'")

        served = scrape(metrics_port)
        assert served.value("infermesh_gateway_requests_total", model="toy-classifier", version="1", code="OK") == 3
        assert served.value("infermesh_gateway_stage_duration_seconds_count", model="toy-classifier", version="1",
                            service="scheduler", stage="queue_wait") == 3
