"""Every metric the dashboards, alerts and autoscalers use (deploy/observability/metrics.yaml)
is exported by the running service that owns it, with at least the contract's labels."""

from __future__ import annotations

import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.processes import ROOT, free_port, running_mesh

pytestmark = pytest.mark.integration

# gpu_only metrics are registered only where CUDA is available: tests/unit/worker/test_gpu_metrics.py
# holds them to the contract with a fake torch.cuda.
CONTRACT = [m for m in yaml.safe_load((ROOT / "deploy/observability/metrics.yaml").read_text())["metrics"]
            if not m.get("gpu_only")]
TENANTS = ROOT / "deploy/local/tenants.yaml"
AUTH = (("authorization", "Bearer demo-key-alpha"),)


def _scrape(port: int) -> dict[str, tuple[str, list[set[str]]]]:
    """Exported families: name -> (type, label sets of its samples)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        families[name] = (family.type, [set(s.labels) - {"le"} for s in family.samples])
    return families


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("metrics-mesh")
    ports = {service: free_port() for service in ("gateway", "scheduler", "classifier", "generator")}
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler("--metrics-port", str(ports["scheduler"]))
        mesh.start_worker("toy-classifier", "--metrics-port", str(ports["classifier"]))
        mesh.start_worker("toy-generator", "--metrics-port", str(ports["generator"]))
        mesh.start_gateway("--metrics-port", str(ports["gateway"]), "--tenants-file", str(TENANTS))
        with session_tls.channel(mesh.gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3))
            for _ in range(3):
                stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="toy-classifier"),
                                                          image=image), timeout=10, metadata=AUTH)
                list(stub.Generate(gateway_pb2.GenerateRequest(
                    model=common_pb2.ModelRef(name="toy-generator"), prompt="ab",
                    sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=10, metadata=AUTH))
        worker = _scrape(ports["classifier"]) | _scrape(ports["generator"])
        yield {"gateway": _scrape(ports["gateway"]), "scheduler": _scrape(ports["scheduler"]), "worker": worker}


@pytest.mark.parametrize("metric", CONTRACT, ids=[m["name"] for m in CONTRACT])
def test_contract_metric_is_exported_with_its_labels(exported, metric):
    service = metric["name"].split("_")[1]
    families = exported[service]
    assert metric["name"] in families, f"{service} does not export {metric['name']}"
    kind, label_sets = families[metric["name"]]
    assert kind == metric["type"]
    for labels in label_sets:
        assert set(metric["labels"]) <= labels, f"{metric['name']} samples carry {labels}, contract {metric['labels']}"

