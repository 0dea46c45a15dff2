"""What a refused Generate costs: CPU per call at the gateway and at the client, by where it is refused.

    .venv/bin/python -m bench.overload.bench_refusal_cost [--calls 3000] [--concurrency 32]

Under overload most calls are refusals (bench_slo, tinylm at 4x: ~750/s), and on a small box their CPU
is taken from the worker's steps. Starts a scheduler, a mock generator and a gateway, then sends
`--calls` Generates of each kind, `--concurrency` at a time, and reads the gateway's CPU (/proc) and
this process's around each batch:

- bare grpc.aio: a server of its own whose handler aborts at once (the floor any refusal pays), and
  the same server answering as the gateway answers an overload (status, message, and the retry hint
  as `grpc-retry-pushback-ms` plus google.rpc.RetryInfo in the trailers; set, not aborted);
- no key: refused at authentication, the gateway's cheapest refusal;
- unmeetable: a TPOT target of 1 ms, refused after auth, routing and the deadline check, at the TTFT
  admission (FAILED_PRECONDITION; the gateway must have heard a prediction first);
- waited: `x-request-start` 1.5 s before the send, past the 1 s TTFT target, so refused at the TTFT
  admission for its wait before the handler (RESOURCE_EXHAUSTED with a retry hint): most refusals
  bench_slo's TTFT-admission gateway answers at 4x are this one or its prediction-only twin;
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
import uvloop

from bench.harness.cpu import busy_cpu_s, cpu_seconds, idle_rates
from bench.harness.mesh_ready import WORKER_ENV, wait_attached
from bench.overload.bench_overload import KEYS, TENANTS_PATH
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import ResourceExhausted
from services.common.status import set_error_status
from tools.testbed.processes import free_port, running_mesh

GENERATE = "/infermesh.v1.Inference/Generate"
# What the bare server answers with a retry hint: a gateway overload refusal's length and hint.
OVERLOADED = ResourceExhausted("overloaded: model 'mock-generator' would start a critical stream in 250 ms at best, past "
                               "its TTFT target 200 ms; retry after 0.05 s", retry_after_s=0.05)
# Sent this long before the call, a request has waited past its 1 s TTFT target before the gateway's handler ran.
WAITED_S = 1.5


def _request(tpot_ms: int) -> bytes:
    return gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name="mock-generator"), prompt="hello there",
        sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, seed=1),
        objectives=gateway_pb2.LatencyObjectives(ttft_ms=1000, tpot_ms=tpot_ms)).SerializeToString()


async def _send(address: str, method: str, body: bytes, api_key: str, num_calls: int, concurrency: int,
                waited_s: float = 0.0) -> Counter:
    codes: Counter = Counter()
    gate = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(method)

        async def one() -> None:
            async with gate:
                metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),)
                if waited_s:
                    metadata += (("x-request-start", f"t={round((time.time() - waited_s) * 1e6)}"),)
                try:
                    async for _ in call(body, timeout=10, metadata=metadata):
                        pass
                    codes["OK"] += 1
                except grpc.RpcError as err:
                    codes[err.code().name] += 1

        await asyncio.gather(*(one() for _ in range(num_calls)))
    return codes


def _bare_server(port: int, with_hint: bool) -> None:
    async def serve() -> None:
        async def refuse(request, context):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "refused")
            yield b""

        async def refuse_with_hint(request, context):
            set_error_status(context, OVERLOADED)
            return
            yield b""

        server = grpc.aio.server()
        handlers = {"Generate": grpc.unary_stream_rpc_method_handler(refuse_with_hint if with_hint else refuse)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("infermesh.v1.Inference", handlers),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())  # as the gateway runs


def _measure(name: str, pid: int, address: str, body: bytes, api_key: str, args: argparse.Namespace,
             waited_s: float = 0.0, idle_cpu_per_s: float = 0.0) -> dict:
    """`idle_cpu_per_s`: the server's CPU rate with nothing sent (its pollers and timers), taken off."""
    asyncio.run(_send(address, GENERATE, body, api_key, 100, args.concurrency, waited_s))  # warm-up
    server_before, client_before, began = cpu_seconds(pid), time.process_time(), time.monotonic()
    codes = asyncio.run(_send(address, GENERATE, body, api_key, args.calls, args.concurrency, waited_s))
    wall_s = time.monotonic() - began
    row = {"kind": name, "codes": dict(codes), "calls_per_s": args.calls / wall_s,
           "server_us_per_call": 1e6 * busy_cpu_s(pid, server_before, idle_cpu_per_s, wall_s) / args.calls,
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
    for name, with_hint in (("bare grpc.aio (abort at once)", False),
                            ("bare grpc.aio (status + retry hint, set)", True)):
        port = free_port()
        bare = multiprocessing.get_context("spawn").Process(target=_bare_server, args=(port, with_hint), daemon=True)
        bare.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=30)  # a spawned interpreter starts slowly
            assert bare.pid is not None
            _measure(name, bare.pid, f"127.0.0.1:{port}", b"", "x", args)
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
        idle_cpu_per_s = idle_rates({"gateway": gateway.proc.pid}, 2.0)["gateway"]
        print(f"(gateway idle: {1000 * idle_cpu_per_s:.1f} ms CPU/s, taken off its rows)")
        for name, body, api_key, waited_s in (
                ("no key (auth)", _request(1000), "not-a-key", 0.0),
                ("TPOT unmeetable (TTFT admission)", _request(1), key, 0.0),
                ("waited past its TTFT target (TTFT admission, retry hint)", _request(1000), key, WAITED_S),
                ("served, 1 token", _request(1000), key, 0.0)):
            _measure(name, gateway.proc.pid, gateway.address, body, api_key, args, waited_s, idle_cpu_per_s)


if __name__ == "__main__":
    main()
