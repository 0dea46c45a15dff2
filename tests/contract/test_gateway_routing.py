"""A routing file decides which models exist at the gateway and where each version goes;
a gateway never starts on a bad routing or tenants file."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import yaml

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT, status_of
from tools.testbed.processes import ROOT, running_mesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-routing")
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        routing = tmp / "routing.yaml"
        routing.write_text(yaml.safe_dump({"models": {
            "toy-classifier": {"default_version": "1", "endpoints": [mesh.scheduler.address]},
        }}), encoding="utf-8")
        mesh.start_gateway("--routing-file", str(routing))
        with session_tls.channel(mesh.gateway.address) as channel:
            yield gateway_pb2_grpc.InferenceStub(channel)


def _classify(stub, name: str, version: str = ""):
    return stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=name, version=version),
                                                     image=BRIGHT), timeout=10)


def test_listed_model_is_served_at_its_default_version(routed):
    reply = _classify(routed, "toy-classifier")
    assert (reply.model.version, reply.labels[0].label) == ("1", "bright")


@pytest.mark.parametrize(
    ("name", "version", "message"),
    [
        ("nope", "", "unknown model 'nope'"),
        ("toy-generator", "", "unknown model 'toy-generator'"),  # attached, but not routed by this gateway
        ("toy-classifier", "9", "unknown version '9' of model 'toy-classifier'"),
    ],
)
def test_models_and_versions_outside_the_routing_table_are_not_found(routed, name, version, message):
    got = status_of(lambda: _classify(routed, name, version))
    assert (got.code, got.message) == (grpc.StatusCode.NOT_FOUND, message)


@pytest.mark.parametrize(
    ("flag", "content", "message"),
    [
        ("--routing-file", "models: {}\n", "field 'models': must be a non-empty mapping of model name to route"),
        ("--tenants-file", "tenants:\n  - id: x\n    priority: urgent\n",
         "tenant 'x': field 'priority': must be one of critical, standard, sheddable, got 'urgent'"),
    ],
)
def test_bad_file_at_start_is_a_configuration_error(tmp_path, flag, content, message):
    path = tmp_path / "bad.yaml"
    path.write_text(content, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "services.gateway", "--allow-anonymous", flag, str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith(f"gateway: configuration error: {path}: ")
    assert message in done.stderr
