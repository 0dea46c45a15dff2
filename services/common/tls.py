"""gRPC credentials from certificate files: server TLS/mTLS that follows rotation, and client channels.

Server side: `grpc.dynamic_ssl_server_credentials` asks a fetcher on every new
handshake; ours returns new material only after the files rotated into a valid set
(`cert_files.CertificateWatcher`). Established connections keep the keys they
negotiated, so streams in flight (a worker's Attach, a gateway's Submit) are not dropped
by a rotation; new connections get the new certificate.

Client side: a process has one identity, its certificate, so the files are set once
per process (`configure_client_tls`, called by the server bootstrap before any service
code runs) and every channel to a peer service comes from `aio_channel` / `channel`.
gRPC Python reads client credentials when a channel is made; a rotated client
certificate reaches channels made after the rotation (docs/security.md: why that is
enough with overlapping validity, and what is left).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from services.common.cert_files import CertificateWatcher, PemMaterial, TlsFiles, read_material
from services.common.config import ConfigError, ServerSettings
from services.common.identity import IdentityPolicy

log = logging.getLogger(__name__)

# tls_client_auth=auto: the gateway's callers are tenants with API keys, not certificate holders.
_NO_CLIENT_CERT_BY_DEFAULT = frozenset({"gateway"})

ChannelOptions = Sequence[tuple[str, object]]


@dataclass(frozen=True)
class TlsPlan:
    """What one listener does about TLS, resolved from the settings and the service's name."""

    files: TlsFiles | None  # None: plaintext
    require_client_cert: bool
    identity_policy: IdentityPolicy | None  # None: no per-method identity check

    @property
    def enabled(self) -> bool:
        return self.files is not None


def plan(settings: ServerSettings, service_name: str) -> TlsPlan:
    """Resolve auto and check the combination; raises ConfigError naming the flag."""
    if not settings.tls_enabled:
        return TlsPlan(None, False, None)
    files = TlsFiles(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file)
    require = settings.tls_client_auth == "require" or (
        settings.tls_client_auth == "auto" and service_name not in _NO_CLIENT_CERT_BY_DEFAULT
    )
    if (require or settings.tls_client_auth == "optional") and not files.ca_path:
        raise ConfigError(f"{service_name} {'requires' if require else 'asks for'} client certificates (--tls-client-auth "
                          f"{settings.tls_client_auth}) but --tls-ca-file is empty: nothing to verify them against")
    policy = None
    if require and settings.tls_identity_check:
        policy = IdentityPolicy(settings.tls_allowed_gateway_ids, settings.tls_allowed_worker_ids,
                                settings.tls_allowed_admin_ids)
    return TlsPlan(files, require, policy)


def client_cert_mode(settings: ServerSettings, service_name: str) -> str:
    """none | optional | require: what a listener asks of clients (auto resolved as `plan` does)."""
    if not settings.tls_enabled:
        return "none"
    if settings.tls_client_auth == "auto":
        return "none" if service_name in _NO_CLIENT_CERT_BY_DEFAULT else "require"
    return settings.tls_client_auth


def _server_config(material: PemMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(material.key_pem, material.cert_pem)], material.ca_pem)


def server_credentials(tls: TlsPlan, clock: Callable[[], float] = time.monotonic
                       ) -> tuple[grpc.ServerCredentials, CertificateWatcher]:
    """Credentials that re-read the files when they rotate; raises CertificateError for bad files."""
    if tls.files is None:
        raise ValueError("server_credentials needs a TLS plan with certificate files (plaintext has none)")
    watcher = CertificateWatcher(tls.files, clock)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        material = watcher.poll()
        return None if material is None else _server_config(material)

    credentials = grpc.dynamic_ssl_server_credentials(
        _server_config(watcher.current), fetch, require_client_authentication=tls.require_client_cert
    )
    return credentials, watcher


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Verify the server against files.ca_path (system roots when empty) and present our certificate."""
    material = read_material(files)
    return grpc.ssl_channel_credentials(material.ca_pem, material.key_pem, material.cert_pem)


_client_files: TlsFiles | None = None


def configure_client_tls(files: TlsFiles | None) -> None:
    """Set this process's client identity for every channel made afterwards; None: plaintext."""
    global _client_files
    if files is not None:
        read_material(files)  # fail at start, naming the file, rather than at the first call
    _client_files = files


def aio_channel(target: str, options: ChannelOptions | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to a peer service: TLS with this process's certificate when configured."""
    if _client_files is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, channel_credentials(_client_files), options=options)


def channel(target: str, options: ChannelOptions | None = None) -> grpc.Channel:
    """The blocking-API twin of aio_channel, for tools."""
    if _client_files is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, channel_credentials(_client_files), options=options)
