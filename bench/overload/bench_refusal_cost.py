"""What a refused Generate costs: CPU per call at the gateway and at the client, by where it is refused.

    .venv/bin/python -m bench.overload.bench_refusal_cost [--calls 3000] [--concurrency 32]

Under overload most calls are refusals (bench_slo, tinylm at 4x: ~750/s), and on a small box their CPU
is taken from the worker's steps. Starts a scheduler, a mock generator and a gateway, then sends
`--calls` Generates of each kind, `--concurrency` at a time, and reads the gateway's CPU (/proc) and
this process's around each batch:

- bare grpc.aio: a server of its own whose handler aborts at once (the floor any refusal pays);
- no key: refused at authentication, the gateway's cheapest refusal;
- unmeetable: a TPOT target of 1 ms, refused after auth, routing and the deadline check, at the TTFT
  admission (FAILED_PRECONDITION; the gateway must have heard a prediction first);
- served: one token, for comparison.

Prints a table; the box is shared: give the load average with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.harness.cpu import cpu_seconds
from bench.harness.mesh_ready import WORKER_ENV, wait_attached
from bench.overload.bench_overload import KEYS, TENANTS_PATH
from infermesh.v1 import common_pb2, gateway_pb2
from tools.testbed.processes import free_port, running_mesh

GENERATE = "/infermesh.v1.Inference/Generate"


def _request(tpot_ms: int) -> bytes:
    return gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name="mock-generator"), prompt="hello there",
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=1),
        objectives=gateway_pb2.LatencyObjectives(ttft_ms=1000, tpot_ms=tpot_ms)).SerializeToString()


async def _send(address: str, method: str, body: bytes, api_key: str, num_calls: int, concurrency: int) -> Counter:
    codes: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(method)

        async def one() -> None:
            async with gate:
                try:
                    async for _ in call(body, timeout=10, metadata=(("authorization", f"Bearer {api_key}"),)):
                        pass
                    codes["OK"] += 1
                except grpc.RpcError as err:
                    codes[err.code().name] += 1

        await asyncio.gather(*(one() for _ in range(num_calls)))
    return codes


def _bare_server(port: int) -> None:
    async def serve() -> None:
        async def refuse(request, context):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")
            yield b""

        server = grpc.aio.server()
        handlers = {"Generate": grpc.unary_stream_rpc_method_handler(refuse)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("infermesh.v1.Inference", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _measure(name: str, pid: int, address: str, body: bytes, api_key: str, args: argparse.Namespace) -> dict:
    asyncio.run(_send(address, GENERATE, body, api_key, 100, args.concurrency))  # warm-up
    server_before, client_before, began = cpu_seconds(pid), time.process_time(), time.monotonic()
    codes = _send(address, GENERATE, body, api_key, args.calls, args.concurrency)
    codes = asyncio.run(codes)
    row = {"kind": name, "codes": dict(codes), "calls_per_s": args.calls / (time.monotonic() - began),
           "server_us_per_call": 1e6 * (cpu_seconds(pid) - server_before) / args.calls,
           "client_us_per_call": 1e6 * (time.process_time() - client_before) / args.calls}
    print(f"| {name} | {row['server_us_per_call']:.0f} | {row['client_us_per_call']:.0f} | {row['calls_per_s']:.0f} | "
          f"{', '.join(f'{k} {v}' for k, v in codes.items())} |", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| refused | server CPU us/call | client CPU us/call | calls/s | codes |\n| --- | --- | --- | --- | --- |")
    port = free_port()
    bare = multiprocessing.get_context("spawn").Process(target=_bare_server, args=(port,), daemon=True)
    bare.start()
    try:
        time.sleep(1.0)
        assert bare.pid is not None
        _measure("bare grpc.aio (abort at once)", bare.pid, f"127.0.0.1:{port}", b"", "x", args)
    finally:
        bare.kill()
    with tempfile.TemporaryDirectory(prefix="bench-refusal-") as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        mesh.start_scheduler("--log-level", "WARNING")
        mesh.start_worker("mock-generator", "--log-level", "WARNING", "--mock-profile",
                          "step_ms=10,per_token_us=200,max_num_seqs=32,num_kv_blocks=2048", env=WORKER_ENV)
        wait_attached(mesh.scheduler.address, 1)
        gateway = mesh.start_gateway("--tenants-file", str(TENANTS_PATH), "--log-level", "WARNING",
                                     "--pressure-poll-interval-ms", "100")
        assert gateway.proc is not None
        key = KEYS["gen-critical"]
        asyncio.run(_send(gateway.address, GENERATE, _request(1000), key, 20, 4))  # a prediction to judge by
        time.sleep(0.5)
        for name, body, api_key in (("no key (auth)", _request(1000), "not-a-key"),
                                    ("TPOT unmeetable (TTFT admission)", _request(1), key),
                                    ("served, 1 token", _request(1000), key)):
            _measure(name, gateway.proc.pid, gateway.address, body, api_key, args)


if __name__ == "__main__":
    main()
