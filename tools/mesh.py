"""Local mesh helper: wait until every service reports SERVING, the quota store answers, and
models are attached.

    python -m tools.mesh wait --health 127.0.0.1:50051 127.0.0.1:50052 ... \
        --store 127.0.0.1:6390 --gateway 127.0.0.1:50051 --models digits tinylm --timeout-s 120
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc


def health_status(address: str, timeout_s: float = 1.0) -> int | None:
    """The server's overall grpc.health.v1 status, or None when it does not answer."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return None
    return reply.status


def is_serving(address: str, timeout_s: float = 1.0) -> bool:
    return health_status(address, timeout_s) == health_pb2.HealthCheckResponse.SERVING


def store_answers(address: str, timeout_s: float = 1.0) -> bool:
    """True when a Valkey/Redis at host:port answers PING with PONG. Speaks the one RESP exchange
    itself, so waiting for the store needs no client library; a store still loading its data
    answers an error (-LOADING), which is not ready."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = conn.recv(64)
                if not chunk:
                    break
                reply += chunk
    except (OSError, ValueError):
        return False
    return reply == b"+PONG\r\n"


def ready_models(gateway: str, api_key: str = "", timeout_s: float = 2.0) -> set[str]:
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    try:
        with grpc.insecure_channel(gateway) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            reply = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError:
        return set()
    return {m.model.name for m in reply.models if m.ready}


def wait(health: list[str], gateway: str | None, models: list[str], timeout_s: float, api_key: str = "",
         stores: Sequence[str] = ()) -> bool:
    give_up = time.monotonic() + timeout_s
    pending = set(health)
    silent_stores = set(stores)
    while time.monotonic() < give_up:
        pending = {address for address in pending if not is_serving(address)}
        silent_stores = {address for address in silent_stores if not store_answers(address)}
        missing = set(models) - ready_models(gateway, api_key) if gateway and models else set()
        if not pending and not silent_stores and not missing:
            return True
        time.sleep(0.2)
    print(f"not ready after {timeout_s:.0f}s: services {sorted(pending)} stores {sorted(silent_stores)} "
          f"models {sorted(missing)}", file=sys.stderr)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.mesh")
    sub = parser.add_subparsers(dest="command", required=True)
    waiter = sub.add_parser("wait", help="wait until services are SERVING and models are attached")
    waiter.add_argument("--health", nargs="+", default=[], help="host:port of each service's health endpoint")
    waiter.add_argument("--store", nargs="*", default=[], help="host:port of each quota store (Valkey/Redis PING)")
    waiter.add_argument("--gateway", help="gateway host:port, to check that --models are attached")
    waiter.add_argument("--models", nargs="*", default=[])
    waiter.add_argument("--timeout-s", type=float, default=120.0)
    waiter.add_argument("--api-key", default="", help="sent as 'authorization: Bearer' when listing models")
    args = parser.parse_args(argv)
    return 0 if wait(args.health, args.gateway, args.models, args.timeout_s, args.api_key, args.store) else 1


if __name__ == "__main__":
    sys.exit(main())
