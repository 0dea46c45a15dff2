"""Local mesh helpers.

wait: until every service reports SERVING, the quota store answers, and models are attached.

    python -m tools.mesh wait --health 127.0.0.1:50051 127.0.0.1:50052 ... \
        --store 127.0.0.1:6390 --gateway 127.0.0.1:50051 --models digits tinylm --timeout-s 120 \
        --ca-file run/tls/ca.pem --cert-file run/tls/gateway.pem --key-file run/tls/gateway-key.pem

With --ca-file every call is TLS, verifying the services against that CA; the schedulers and workers
require a client certificate (mTLS), so the mesh's own wait presents one with --cert-file/--key-file
(the health service is open to every verified identity).

keep: run a command and start it again whenever it exits, as a Deployment restarts a pod. honcho
(`make up`) stops the whole mesh when any one process exits, so without this, stopping or killing
one scheduler to watch the other take over would end every process.

    python -m tools.mesh keep -- python -m services.scheduler --port 50053
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.client_files import credentials_from_files, open_channel
from services.common.health_probe import health_status


def is_serving(address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    return health_status(address, timeout_s, credentials) == health_pb2.HealthCheckResponse.SERVING


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


class KeyRefused(Exception):
    """The gateway answered, and refused the readiness key: waiting longer cannot help."""


def ready_models(gateway: str, api_key: str = "", timeout_s: float = 2.0,
                 credentials: grpc.ChannelCredentials | None = None) -> set[str]:
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    try:
        with open_channel(gateway, credentials) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            reply = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            raise KeyRefused(f"{exc.code().name}: {exc.details()}") from None
        return set()
    return {m.model.name for m in reply.models if m.ready}


def key_problem(tenants_file: str, api_key: str, allow_anonymous: bool = False) -> str | None:
    """Why `api_key` cannot pass the gateway's auth with this tenants file; None when it can."""
    if not tenants_file:
        if allow_anonymous:
            return None  # the gateway admits every caller
        return ("no tenants file: the gateway fails closed and will not start; set MESH_TENANTS_FILE, "
                "or MESH_ALLOW_ANONYMOUS=true to admit everyone (development only)")
    from services.gateway.tenants.directory import TenantConfigError, TenantDirectory, load_tenant_config

    try:
        directory = TenantDirectory(load_tenant_config(tenants_file))
    except (OSError, TenantConfigError) as exc:
        return f"the tenants file {tenants_file} is unusable: {exc}"
    try:
        directory.authenticate_key(api_key)
    except Exception:  # noqa: BLE001 - Unauthenticated, whatever its module
        return (f"the readiness key is not in {tenants_file}: `make up` checks readiness with MESH_API_KEY "
                f"(now {api_key[:4]}...); set MESH_API_KEY to a key of a tenant in that file")
    return None


def wait(health: list[str], gateway: str | None, models: list[str], timeout_s: float, api_key: str = "",
         stores: Sequence[str] = (), credentials: grpc.ChannelCredentials | None = None) -> bool:
    give_up = time.monotonic() + timeout_s
    pending = set(health)
    silent_stores = set(stores)
    while time.monotonic() < give_up:
        pending = {address for address in pending if not is_serving(address, credentials=credentials)}
        silent_stores = {address for address in silent_stores if not store_answers(address)}
        try:
            missing = (set(models) - ready_models(gateway, api_key, credentials=credentials)
                       if gateway and models else set())
        except KeyRefused as exc:
            print(f"the gateway refused the readiness key ({exc}): it is not a key of the gateway's tenants "
                  f"file; set MESH_API_KEY to one that is", file=sys.stderr)
            return False
        if not pending and not silent_stores and not missing:
            return True
        time.sleep(0.2)
    print(f"not ready after {timeout_s:.0f}s: services {sorted(pending)} stores {sorted(silent_stores)} "
          f"models {sorted(missing)}", file=sys.stderr)
    return False


def keep_running(argv: Sequence[str], restart_delay_s: float = 1.0, max_restarts: int | None = None) -> int:
    """Run argv, and again each time it exits, until this process gets SIGTERM or SIGINT: then the
    signal goes to the child (which drains as it would under a kubelet), and its exit status is
    returned once it exits. `max_restarts` bounds the restarts (tests); None: no bound."""
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        num_restarts = 0
        while True:
            child = subprocess.Popen(list(argv))
            if stopping:  # the signal came while the child was being started: it missed the forward
                child.send_signal(signal.SIGTERM)
            returncode = child.wait()
            if stopping or (max_restarts is not None and num_restarts >= max_restarts):
                return returncode
            num_restarts += 1
            print(f"tools.mesh keep: {' '.join(argv[:4])} ... exited with {returncode}; "
                  f"starting it again in {restart_delay_s:g}s (restart {num_restarts})", file=sys.stderr, flush=True)
            time.sleep(restart_delay_s)  # a signal during the pause ends it: stopping is then set
            if stopping:
                return returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    waiter.add_argument("--ca-file", default="", help="CA bundle: talk TLS and verify the services (empty: plaintext)")
    waiter.add_argument("--cert-file", default="", help="client certificate for the mTLS ports (with --ca-file)")
    waiter.add_argument("--key-file", default="", help="key of --cert-file")
    checker = sub.add_parser("check-key", help="exit 1 unless the API key passes auth with this tenants file")
    checker.add_argument("--tenants-file", default="", help="the gateway's tenants YAML (empty: refused "
                         "unless --allow-anonymous)")
    checker.add_argument("--api-key", required=True)
    checker.add_argument("--allow-anonymous", default="false", choices=("true", "false"),
                         help="the gateway runs with --allow-anonymous (default: false)")
    keeper = sub.add_parser("keep", help="run a command, restarting it whenever it exits, until SIGTERM/SIGINT")
    keeper.add_argument("--restart-delay-s", type=float, default=1.0)
    keeper.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    if args.command == "keep":
        command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not command:
            parser.error("keep needs a command after --")
        return keep_running(command, args.restart_delay_s)
    if args.command == "check-key":
        problem = key_problem(args.tenants_file, args.api_key, args.allow_anonymous == "true")
        if problem:
            print(f"make up: {problem}", file=sys.stderr)
        return 1 if problem else 0
    credentials = credentials_from_files(args.ca_file, args.cert_file, args.key_file)
    ready = wait(args.health, args.gateway, args.models, args.timeout_s, args.api_key, args.store, credentials)
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
