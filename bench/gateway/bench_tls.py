"""What TLS and the per-method identity check cost on a gRPC hop: per call, per streamed message, per connection.

    .venv/bin/python -m bench.gateway.bench_tls [--num-calls 2000] [--num-messages 20000] [--num-connections 50]
                                        [--rounds 3] [--quick]

One grpc.aio server and its client in this process, on one event loop, so each figure
is the client's and the server's Python and TLS work together (what a hop costs the
machine, not one side's share). The server is built the way services/common/server.py
builds it, for three modes:

  plaintext   add_insecure_port
  mtls        dynamic_ssl_server_credentials from tools/dev_ca.py files, client certs required,
              --tls-identity-check off
  mtls_ids    the same plus the identity interceptor (services/common/authz.py)

and serves two methods under the scheduler's names so the policy applies: a unary echo
(`GetPressure`) and a server stream of 64-byte messages (`Generate`), both as raw bytes.
Phases per mode: `unary` (sequential calls: us per call), `stream` (one stream: us per
message), `connect` (new channel, handshake and first call: ms per connection). Each is
given as wall time and as this process's CPU time (client, server and gRPC's threads
together), the figure that holds up on a box shared with other work.
Rounds alternate the mode order; the table gives every round and the medians.
Prints a table and writes ``bench/results/tls.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.harness.results import RESULTS_DIR, write_report
from services.common import tls
from services.common.authz import IdentityInterceptor
from services.common.config import ServerSettings
from tools.dev_ca import write_service_certs

RESULTS_PATH = RESULTS_DIR / "tls.json"
MODES = ("plaintext", "mtls", "mtls_ids")
_UNARY = "/infermesh.v1.Scheduler/GetPressure"
_STREAM = "/infermesh.v1.Scheduler/Generate"
_MESSAGE = bytes(64)
_FIGURES = ("unary_us_per_call", "unary_cpu_us_per_call", "stream_us_per_message", "stream_cpu_us_per_message",
            "connect_ms", "connect_cpu_ms")


def _handlers(num_messages: int) -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context) -> bytes:
        return request

    async def stream(request: bytes, context):
        for _ in range(num_messages):
            yield _MESSAGE

    return grpc.method_handlers_generic_handler("infermesh.v1.Scheduler", {
        "GetPressure": grpc.unary_unary_rpc_method_handler(echo),
        "Generate": grpc.unary_stream_rpc_method_handler(stream),
    })


async def _start(mode: str, certs: dict, num_messages: int) -> tuple[grpc.aio.Server, int]:
    files = certs["scheduler"]
    settings = ServerSettings(
        tls_cert_file=str(files.cert_path), tls_key_file=str(files.key_path), tls_ca_file=str(files.ca_path),
        tls_identity_check=mode == "mtls_ids",
    )
    plan = tls.plan(settings, "scheduler")
    interceptors = [IdentityInterceptor(plan.identity_policy)] if plan.identity_policy else []
    server = grpc.aio.server(interceptors=interceptors)
    server.add_generic_rpc_handlers((_handlers(num_messages),))
    if mode == "plaintext":
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        credentials, _watcher = tls.server_credentials(plan)
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


def _channel(mode: str, certs: dict, port: int) -> grpc.aio.Channel:
    target = f"127.0.0.1:{port}"
    if mode == "plaintext":
        return grpc.aio.insecure_channel(target)
    files = certs["gateway"]
    credentials = grpc.ssl_channel_credentials(files.ca_path.read_bytes(), files.key_path.read_bytes(),
                                               files.cert_path.read_bytes())
    return grpc.aio.secure_channel(target, credentials)


class _Clocks:
    """Wall time and this process's CPU time (all threads: the client, the server and gRPC's own)."""

    def __init__(self) -> None:
        self._wall_s, self._cpu_s = time.perf_counter(), time.process_time()

    def per(self, count: int, scale: float) -> tuple[float, float]:
        wall_s, cpu_s = time.perf_counter() - self._wall_s, time.process_time() - self._cpu_s
        return wall_s / count * scale, cpu_s / count * scale


async def _phase_unary(channel: grpc.aio.Channel, num_calls: int) -> tuple[float, float]:
    call = channel.unary_unary(_UNARY)
    await call(_MESSAGE, timeout=10)  # connected and warm before the clock starts
    clocks = _Clocks()
    for _ in range(num_calls):
        await call(_MESSAGE, timeout=10)
    return clocks.per(num_calls, 1e6)


async def _phase_stream(channel: grpc.aio.Channel, num_messages: int) -> tuple[float, float]:
    clocks = _Clocks()
    received = 0
    async for _message in channel.unary_stream(_STREAM)(b"", timeout=60):
        received += 1
    assert received == num_messages, received
    return clocks.per(num_messages, 1e6)


async def _phase_connect(mode: str, certs: dict, port: int, num_connections: int) -> tuple[float, float]:
    clocks = _Clocks()
    for _ in range(num_connections):
        async with _channel(mode, certs, port) as channel:
            await channel.unary_unary(_UNARY)(_MESSAGE, timeout=10)
    return clocks.per(num_connections, 1e3)


async def _measure(mode: str, certs: dict, args) -> dict:
    server, port = await _start(mode, certs, args.num_messages)
    try:
        async with _channel(mode, certs, port) as channel:
            unary = await _phase_unary(channel, args.num_calls)
            stream = await _phase_stream(channel, args.num_messages)
        connect = await _phase_connect(mode, certs, port, args.num_connections)
    finally:
        await server.stop(0)
    return {"unary_us_per_call": unary[0], "unary_cpu_us_per_call": unary[1],
            "stream_us_per_message": stream[0], "stream_cpu_us_per_message": stream[1],
            "connect_ms": connect[0], "connect_cpu_ms": connect[1]}


async def run(args) -> dict:
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = write_service_certs(Path(tmp))
        warm_up = argparse.Namespace(**{**vars(args), "num_calls": 100, "num_messages": 1000, "num_connections": 3})
        for mode in MODES:  # imports, first handshakes, allocator growth: not part of any mode's figure
            await _measure(mode, certs, warm_up)
        for number in range(args.rounds):
            order = MODES if number % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                rounds.append({"round": number, "mode": mode, **await _measure(mode, certs, args)})
    medians = {
        mode: {key: statistics.median(r[key] for r in rounds if r["mode"] == mode) for key in _FIGURES}
        for mode in MODES
    }
    return {
        "params": vars(args) | {"out": str(args.out)},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "grpc": grpc.__version__,
                    "load_avg_1m": os.getloadavg()[0]},
        "rounds": rounds,
        "medians": medians,
        "over_plaintext": {mode: {k: medians[mode][k] / medians["plaintext"][k] for k in medians[mode]}
                           for mode in MODES},
    }


def print_table(results: dict) -> None:
    print("wall (CPU of the process) per unit")
    print(f"{'round':>5} {'mode':<10} {'unary us/call':>20} {'stream us/msg':>18} {'connect ms':>16}")

    def row(m: dict) -> str:
        return (f"{m['unary_us_per_call']:>9.1f} ({m['unary_cpu_us_per_call']:>7.1f}) "
                f"{m['stream_us_per_message']:>8.2f} ({m['stream_cpu_us_per_message']:>6.2f}) "
                f"{m['connect_ms']:>6.2f} ({m['connect_cpu_ms']:>6.2f})")

    for r in results["rounds"]:
        print(f"{r['round']:>5} {r['mode']:<10} {row(r)}")
    print("medians, then x plaintext:")
    for mode, m in results["medians"].items():
        ratio = results["over_plaintext"][mode]
        print(f"{'':>5} {mode:<10} {row(m)}")
        print(f"{'':>5} {'':<10} {row(ratio)}")
    print(f"load average (1 min) at the end: {results['machine']['load_avg_1m']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-calls", type=int, default=2000)
    parser.add_argument("--num-messages", type=int, default=20000)
    parser.add_argument("--num-connections", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a short run (fewer calls, messages, connections)")
    parser.add_argument("--out", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    if args.quick:
        args.num_calls, args.num_messages, args.num_connections, args.rounds = 300, 3000, 10, 1
    results = asyncio.run(run(args))
    print_table(results)
    write_report(args.out, results)


if __name__ == "__main__":
    main()
