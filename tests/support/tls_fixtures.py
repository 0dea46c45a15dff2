"""Certificates from tools/dev_ca.py and TLS clients, for the TLS integration tests."""

from __future__ import annotations

import datetime as dt
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tools.dev_ca import DevCA, IssuedCert, ServiceFiles, write_service_certs


@dataclass
class DevPki:
    """A dev CA with the three service certs written under a folder, plus a rogue CA and an expired cert."""

    folder: Path
    ca: DevCA
    files: dict[str, ServiceFiles]
    rogue: IssuedCert  # a gateway cert signed by a CA the services do not trust
    expired: IssuedCert  # a gateway cert from the right CA that expired yesterday

    @classmethod
    def create(cls, folder: Path) -> DevPki:
        ca = DevCA()
        files = write_service_certs(folder, ca=ca)
        now = dt.datetime.now(dt.UTC)
        expired = ca.issue_service("gateway", not_before=now - dt.timedelta(days=2),
                                   not_after=now - dt.timedelta(days=1))
        return cls(folder, ca, files, DevCA("rogue CA").issue_service("gateway"), expired)

    def client(self, service: str) -> grpc.ChannelCredentials:
        """Credentials presenting `service`'s certificate and trusting the dev CA."""
        paths = self.files[service]
        return grpc.ssl_channel_credentials(paths.ca_path.read_bytes(), paths.key_path.read_bytes(),
                                            paths.cert_path.read_bytes())

    def client_with(self, cert: IssuedCert | None) -> grpc.ChannelCredentials:
        """Credentials trusting the dev CA and presenting `cert` (or no client certificate)."""
        ca_pem = self.ca.cert_pem
        if cert is None:
            return grpc.ssl_channel_credentials(ca_pem)
        return grpc.ssl_channel_credentials(ca_pem, cert.key_pem, cert.cert_pem)


def tls_health(address: str, credentials: grpc.ChannelCredentials, timeout_s: float = 2.0) -> int | None:
    """The server's grpc.health.v1 status over TLS, or None when the call fails."""
    try:
        with grpc.secure_channel(address, credentials) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
    except grpc.RpcError:
        return None


def wait_tls_serving(process, credentials: grpc.ChannelCredentials, timeout_s: float = 60.0) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if not process.alive():
            raise RuntimeError(f"{process.name} exited with {process.proc.returncode}:\n{process.log_tail()}")
        if tls_health(process.address, credentials, timeout_s=1.0) == health_pb2.HealthCheckResponse.SERVING:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{process.name} not SERVING over TLS after {timeout_s}s:\n{process.log_tail()}")


def served_certificate(address: str, cert: IssuedCert, ca_pem: bytes, folder: Path) -> x509.Certificate:
    """The leaf certificate a fresh TLS connection to `address` is shown (a raw handshake, no gRPC)."""
    host, port = address.rsplit(":", 1)
    (folder / "probe.pem").write_bytes(cert.cert_pem)
    (folder / "probe-key.pem").write_bytes(cert.key_pem)
    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.load_cert_chain(folder / "probe.pem", folder / "probe-key.pem")
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname=host) as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
