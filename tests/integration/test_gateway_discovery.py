"""A gateway given `dns:///name:port` finds its schedulers by resolving the name (here `localhost`,
as a headless Service's name would be), polls them and serves through them."""

from __future__ import annotations

import pytest

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT, CLASSIFIER
from tools.testbed.processes import ServiceProcess, free_port, running_mesh

pytestmark = pytest.mark.integration


def test_a_dns_scheduler_address_is_resolved_and_served_through(tmp_path):
    with running_mesh(tmp_path) as mesh:
        scheduler = mesh.start_scheduler()
        mesh.start_worker("toy-classifier", "--toy-compute-ms", "1")
        gateway = ServiceProcess(
            "gateway-dns", "gateway", free_port(),
            ["--scheduler-address", f"dns:///localhost:{scheduler.port}", "--discovery-interval-ms", "200"],
            dict(mesh.env), tmp_path / "gateway-dns.log",
        )
        mesh.processes.append(gateway)
        gateway.start()
        gateway.wait_serving()
        with session_tls.channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            labels = [stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=10)
                      .labels[0].label for _ in range(10)]
            models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    assert labels == ["bright"] * 10
    assert [m.model.name for m in models if m.ready] == ["toy-classifier"]
