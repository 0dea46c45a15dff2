"""Container health check: exit 0 when the service's grpc.health.v1 reports SERVING.

    python /app/healthcheck.py gateway          # dials 127.0.0.1:$INFERMESH_GATEWAY_PORT
    python /app/healthcheck.py 127.0.0.1:50051  # or an explicit host:port

Used by the images' HEALTHCHECK (and so by compose's depends_on); Kubernetes uses
its native gRPC probes instead. Lives here, not in services/, because only the
container images need it.
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICES = ("gateway", "scheduler", "worker")


def target_of(arg: str, environ: dict[str, str]) -> str:
    if arg not in SERVICES:
        return arg
    variable = f"INFERMESH_{arg.upper()}_PORT"
    port = environ.get(variable)
    if not port:
        raise ValueError(f"{variable} is not set; pass host:port instead of {arg!r}")
    return f"127.0.0.1:{port}"


def is_serving(target: str, timeout_s: float) -> bool:
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str], environ: dict[str, str]) -> int:
    if len(argv) != 1:
        print("usage: healthcheck.py gateway|scheduler|worker|HOST:PORT", file=sys.stderr)
        return 2
    try:
        target = target_of(argv[0], environ)
    except ValueError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 2
    return 0 if is_serving(target, timeout_s=2.0) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], dict(os.environ)))
