"""The gateway's public port with TLS: the Inference and KServe services share it, tenants bring
no client certificate, plaintext is refused, and /metrics is served over HTTPS."""

from __future__ import annotations

import ssl
import urllib.request

import grpc
import pytest

from inference import grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc
from tests.support.tls_fixtures import DevPki, tls_health, wait_tls_serving
from tools.testbed.processes import SERVING, ServiceProcess, free_port, running_mesh

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> DevPki:
    return DevPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gateway(pki, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-gateway")
    with running_mesh(tmp, tls=False) as mesh:  # this module brings its own CA
        scheduler = mesh.start_scheduler()
        metrics_port = free_port()
        process = ServiceProcess(
            "gateway", "gateway", free_port(),
            ["--scheduler-address", scheduler.address, "--metrics-port", str(metrics_port),
             *pki.files["gateway"].server_args()],
            {}, tmp / "gateway.log", tls=False)
        mesh.processes.append(process)
        process.start()
        wait_tls_serving(process, pki.client_with(None))
        process.metrics_port = metrics_port
        yield process


def test_a_client_without_a_certificate_reaches_health_and_kserve(gateway, pki):
    assert tls_health(gateway.address, pki.client_with(None)) == SERVING
    with grpc.secure_channel(gateway.address, pki.client_with(None)) as channel:
        live = grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
            grpc_predict_v2_pb2.ServerLiveRequest(), timeout=5)
    assert live.live


def test_plaintext_to_the_gateway_tls_port_fails_cleanly(gateway, pki):
    with grpc.insecure_channel(gateway.address) as channel, pytest.raises(grpc.RpcError) as caught:
        grpc_predict_v2_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(
            grpc_predict_v2_pb2.ServerLiveRequest(), timeout=3)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert tls_health(gateway.address, pki.client_with(None)) == SERVING


def test_metrics_are_served_over_https_and_say_tls_is_on(gateway, pki):
    context = ssl.create_default_context(cadata=pki.ca.cert_pem.decode())
    url = f"https://127.0.0.1:{gateway.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5, context=context).read().decode()
    assert "infermesh_gateway_tls_enabled 1.0" in text


def test_a_plaintext_scheduler_says_so_loudly(gateway):
    scheduler_log = (gateway.log_path.parent / "scheduler.log").read_text()
    assert "TLS is OFF" in scheduler_log
