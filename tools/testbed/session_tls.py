"""The test session's dev CA: every service process a test starts talks mTLS by default.

One CA and one certificate per service (gateway, scheduler, worker) are made on first use
and shared by every test of the session (a P-256 set costs milliseconds); the files live in
a temporary folder removed when the interpreter exits. Each certificate names 127.0.0.1,
localhost and every address of the netns test LAN, so peers verify hosts without a name
override; the tests' own channels to `unix:` forwarders and multi-address targets are
verified as localhost.

Tests reach a process through `channel(address)` / `aio_channel(address)` (or a
ServiceProcess's own `channel()`), which present the gateway's certificate by default:
the scheduler admits Classify, Generate, ListModels and GetPressure only from the gateway.
A test acting as a worker (Attach) asks for `identity="worker"`. Tests about plaintext
start their processes with `tls=False` and dial them with `tls=False`.
"""

from __future__ import annotations

import atexit
import shutil
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import grpc

from tools.dev_ca import ServiceFiles, write_service_certs

# tools/testbed/netns.py's SUBNET; its hosts are numbered from 1 in the order a test names them.
_NETNS_SUBNET = "10.213.77"
_NUM_NETNS_HOSTS = 16

ChannelOptions = Sequence[tuple[str, object]]


@dataclass(frozen=True, eq=False)  # hashed by identity: one per session, a cache key
class SessionPki:
    folder: Path
    files: dict[str, ServiceFiles]

    @property
    def ca_path(self) -> Path:
        return self.files["gateway"].ca_path

    def server_args(self, service: str) -> list[str]:
        """Flags that start `service` with its certificate: mTLS at the scheduler and workers, server
        TLS at the gateway (its auto client-auth), and the same identity on its own outgoing calls."""
        return self.files[service].server_args()

    def credentials(self, identity: str | None = "gateway") -> grpc.ChannelCredentials:
        """Trust the session CA and present `identity`'s certificate (None: no client certificate)."""
        return _credentials(self, identity)

    def ssl_context(self) -> ssl.SSLContext:
        """For raw TLS clients (HTTPS metrics): trusts the session CA."""
        return ssl.create_default_context(cafile=str(self.ca_path))


@cache
def _credentials(pki: SessionPki, identity: str | None) -> grpc.ChannelCredentials:
    ca_pem = pki.ca_path.read_bytes()
    if identity is None:
        return grpc.ssl_channel_credentials(ca_pem)
    paths = pki.files[identity]
    return grpc.ssl_channel_credentials(ca_pem, paths.key_path.read_bytes(), paths.cert_path.read_bytes())


@cache
def session_pki() -> SessionPki:
    folder = Path(tempfile.mkdtemp(prefix="infermesh-pki-"))
    atexit.register(shutil.rmtree, folder, True)
    lan = [f"{_NETNS_SUBNET}.{host}" for host in range(1, _NUM_NETNS_HOSTS + 1)]
    return SessionPki(folder, write_service_certs(folder, ip_addresses=lan))


def credentials(identity: str | None = "gateway", tls: bool = True) -> grpc.ChannelCredentials | None:
    """The session's client credentials for `identity`; None when tls is False (plaintext)."""
    return session_pki().credentials(identity) if tls else None


def _tls_options(address: str, options: ChannelOptions | None) -> list[tuple[str, object]]:
    """Targets whose authority no certificate names are verified as localhost: a multi-address target
    (`ipv4:127.0.0.1:a,127.0.0.1:b`, round_robin over gateways) has the whole list as its authority, and
    a `unix:` target (a netns host's forwarder) its socket path."""
    options = list(options or ())
    if address.startswith("unix:") or (address.startswith(("ipv4:", "ipv6:")) and "," in address):
        options.append(("grpc.ssl_target_name_override", "localhost"))
    return options


def channel(address: str, identity: str | None = "gateway", *, tls: bool = True,
            options: ChannelOptions | None = None) -> grpc.Channel:
    """A blocking channel to a test's service process: mTLS as `identity` unless tls is False."""
    if not tls:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, session_pki().credentials(identity), options=_tls_options(address, options))


def aio_channel(address: str, identity: str | None = "gateway", *, tls: bool = True,
                options: ChannelOptions | None = None) -> grpc.aio.Channel:
    """The grpc.aio twin of `channel`."""
    if not tls:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, session_pki().credentials(identity),
                                   options=_tls_options(address, options))
