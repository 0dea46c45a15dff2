"""services.common.health_probe: the exec probe dials the service's port with the service's own
certificate (the kubelet's gRPC probe brings none), plaintext when the service has no TLS files."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.health_probe import main
from tools.dev_ca import DevCA, write_service_certs


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory):
    """A health server requiring client certificates from the dev CA, like the scheduler's port."""
    ca = DevCA()
    files = write_service_certs(tmp_path_factory.mktemp("pki"), ["scheduler"], ca=ca)["scheduler"]
    credentials = grpc.ssl_server_credentials(
        [(files.key_path.read_bytes(), files.cert_path.read_bytes())], files.ca_path.read_bytes(),
        require_client_auth=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    env = {"INFERMESH_SCHEDULER_PORT": str(port), "INFERMESH_SCHEDULER_TLS_CERT_FILE": str(files.cert_path),
           "INFERMESH_SCHEDULER_TLS_KEY_FILE": str(files.key_path), "INFERMESH_SCHEDULER_TLS_CA_FILE": str(files.ca_path)}
    yield servicer, env
    server.stop(0)


def test_probes_an_mtls_port_with_the_services_own_certificate(mtls_server):
    servicer, env = mtls_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["scheduler"], env) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["scheduler"], env) == 1


def test_without_the_certificate_an_mtls_port_does_not_answer(mtls_server):
    servicer, env = mtls_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["scheduler"], {"INFERMESH_SCHEDULER_PORT": env["INFERMESH_SCHEDULER_PORT"]}) == 1


def test_unreadable_tls_files_are_a_usage_error_naming_the_file(mtls_server, tmp_path, capsys):
    _servicer, env = mtls_server
    assert main(["scheduler"], {**env, "INFERMESH_SCHEDULER_TLS_KEY_FILE": str(tmp_path / "gone.pem")}) == 2
    assert "gone.pem" in capsys.readouterr().err
