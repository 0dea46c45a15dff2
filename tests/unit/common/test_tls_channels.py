"""Client channels from services/common/tls.py: the process's certificate when configured, plaintext otherwise."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from services.common import tls
from services.common.cert_files import CertificateError, TlsFiles
from services.common.config import ServerSettings
from tools.dev_ca import write_service_certs


@pytest.fixture
def certs(tmp_path):
    return write_service_certs(tmp_path)


@pytest.fixture(autouse=True)
def plaintext_afterwards():
    yield
    tls.configure_client_tls(None)


def _files(paths) -> TlsFiles:
    return TlsFiles(str(paths.cert_path), str(paths.key_path), str(paths.ca_path))


async def _mtls_health_server(certs) -> tuple[grpc.aio.Server, int]:
    paths = certs["scheduler"]
    plan = tls.plan(ServerSettings(tls_cert_file=str(paths.cert_path), tls_key_file=str(paths.key_path),
                                   tls_ca_file=str(paths.ca_path)), "scheduler")
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    credentials, _watcher = tls.server_credentials(plan)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


async def _check(port: int) -> int:
    async with tls.aio_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
    return reply.status


async def test_configured_channels_present_the_process_certificate(certs):
    server, port = await _mtls_health_server(certs)
    try:
        tls.configure_client_tls(_files(certs["gateway"]))
        assert await _check(port) == health_pb2.HealthCheckResponse.SERVING
        tls.configure_client_tls(None)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _check(port)  # plaintext to a TLS port
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


def test_configuring_unreadable_files_fails_at_once_naming_the_file(certs, tmp_path):
    files = TlsFiles(str(certs["gateway"].cert_path), str(tmp_path / "gone-key.pem"), str(certs["gateway"].ca_path))
    with pytest.raises(CertificateError, match="cannot read the TLS key file .*gone-key.pem"):
        tls.configure_client_tls(files)


def test_blocking_channels_follow_the_same_setting(certs):
    paths = certs["scheduler"]
    plan = tls.plan(ServerSettings(tls_cert_file=str(paths.cert_path), tls_key_file=str(paths.key_path),
                                   tls_ca_file=str(paths.ca_path)), "scheduler")
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    credentials, _watcher = tls.server_credentials(plan)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        tls.configure_client_tls(_files(certs["worker"]))
        with tls.channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)
