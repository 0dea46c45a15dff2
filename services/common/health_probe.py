"""Liveness/readiness probe from inside the pod or container: exit 0 when the service's
grpc.health.v1 reports SERVING.

    python -m services.common.health_probe gateway           # 127.0.0.1:$INFERMESH_GATEWAY_PORT
    python -m services.common.health_probe 127.0.0.1:50051   # an explicit host:port, plaintext

It dials 127.0.0.1 on the service's port with the service's own TLS files, read from the same
INFERMESH_<SERVICE>_TLS_CERT_FILE / _KEY_FILE / _CA_FILE the service reads: the scheduler and
workers require a client certificate (mTLS), and the kubelet's native gRPC probe sends none, so
Kubernetes runs this as an exec probe. The probe goes through the same port and TLS stack as
real traffic: a certificate the service cannot serve fails it. Without a certificate in the
environment it dials plaintext, as the service then listens.

Exit codes: 0 SERVING; 1 not SERVING or not answering; 2 usage or unreadable TLS files.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import client_files

SERVICES = ("gateway", "scheduler", "worker")


def target_of(arg: str, environ: Mapping[str, str]) -> str:
    """host:port for a service name (127.0.0.1 and its INFERMESH_<SERVICE>_PORT) or an explicit host:port."""
    if arg not in SERVICES:
        return arg
    variable = f"INFERMESH_{arg.upper()}_PORT"
    port = environ.get(variable)
    if not port:
        raise ValueError(f"{variable} is not set; pass host:port instead of {arg!r}")
    return f"127.0.0.1:{port}"


def credentials_of(service: str, environ: Mapping[str, str]) -> grpc.ChannelCredentials | None:
    """Client credentials from the service's own TLS files; None when it has none (plaintext)."""
    prefix = f"INFERMESH_{service.upper()}_TLS_"
    cert_path = environ.get(f"{prefix}CERT_FILE", "")
    if not cert_path:
        return None
    try:
        return client_files.credentials_from_files(environ.get(f"{prefix}CA_FILE", ""), cert_path,
                                          environ.get(f"{prefix}KEY_FILE", ""))
    except OSError as exc:
        raise ValueError(f"cannot read the TLS file {exc.filename}: {exc.strerror}") from None


def health_status(address: str, timeout_s: float = 1.0,
                  credentials: grpc.ChannelCredentials | None = None) -> int | None:
    """The server's overall grpc.health.v1 status, or None when it does not answer (a TLS port
    dialed in plaintext, or with a certificate it refuses, does not answer either)."""
    try:
        with client_files.open_channel(address, credentials) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None
    return reply.status


def main(argv: list[str], environ: Mapping[str, str]) -> int:
    if len(argv) != 1:
        print("usage: python -m services.common.health_probe gateway|scheduler|worker|HOST:PORT", file=sys.stderr)
        return 2
    service = argv[0] if argv[0] in SERVICES else ""
    try:
        target = target_of(argv[0], environ)
        credentials = credentials_of(service, environ) if service else None
    except ValueError as exc:
        print(f"health_probe: {exc}", file=sys.stderr)
        return 2
    status = health_status(target, timeout_s=2.0, credentials=credentials)
    if status == health_pb2.HealthCheckResponse.SERVING:
        return 0
    state = "no answer" if status is None else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"health_probe: {target}: {state}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], os.environ))
