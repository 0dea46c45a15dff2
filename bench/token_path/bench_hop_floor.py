"""The floor under the mesh's latency on this machine: grpc.aio hops with nothing in them.

    .venv/bin/python -m bench.token_path.bench_hop_floor [--requests 200] [--runs 3] [--quick] [--output PATH]

A chain of relay processes, each a grpc.aio server on uvloop (as the mesh's services are) whose
handler only forwards the request's bytes to the next process; the last one echoes them back. The
payload is a digits Classify request's size. A synchronous client, as the overload benchmark's lone
request uses, times round trips through 1 hop and through 3 (client -> gateway -> scheduler ->
worker is three), at three paces:

  back to back   the next request as soon as the last answer came
  every 50 ms    issue 11's lone request (20/s)
  every 200 ms   issue 18's 5/s generate arrivals

No protobuf parsing, no auth, no batching, no model: what is left is the cost of the hops
themselves, and of waking idle processes on a shared 2-core VM, where a process that slept 50 ms
finds its caches and the CPU cold. Compare with `bench_overload --only lone` (issue 11's <= 4 ms
target) and `bench_token_path --only e2e` (issue 18's 10% allowance at 5/s). Prints a table, writes
JSON (bench/results/hop_floor.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.tables import markdown_table
from tools.testbed.processes import free_port, wait_until

RESULTS_PATH = RESULTS_DIR / "hop_floor.json"
METHOD = "/floor.Relay/Forward"
PAYLOAD_BYTES = 800  # a digits ClassifyRequest: 16x16x3 raw pixels plus the model name
PACES_S = {"back to back": 0.0, "every 50 ms": 0.05, "every 200 ms": 0.2}
NUM_HOPS = (1, 3)
# One relay: forwards to argv[2] (its own echo when that is empty). Bytes in, bytes out.
RELAY = """
import sys, grpc, uvloop
async def main():
    server = grpc.aio.server()
    upstream = grpc.aio.insecure_channel(sys.argv[2]).unary_unary(sys.argv[3]) if sys.argv[2] else None
    async def forward(request, context):
        return await upstream(request) if upstream else request
    service, method = sys.argv[3].strip("/").split("/")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_unary_rpc_method_handler(forward)}),))
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()
uvloop.run(main())
"""


@contextmanager
def relay_chain(num_hops: int) -> Iterator[str]:
    """Starts `num_hops` relays, each forwarding to the next; yields the first one's address."""
    ports = [free_port() for _ in range(num_hops)]
    procs = []
    try:
        for i, port in enumerate(ports):
            upstream = f"127.0.0.1:{ports[i + 1]}" if i + 1 < num_hops else ""
            procs.append(subprocess.Popen([sys.executable, "-c", RELAY, str(port), upstream, METHOD]))
        yield f"127.0.0.1:{ports[0]}"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _answers(call, payload: bytes) -> bool:
    try:
        return call(payload, timeout=1.0) == payload
    except grpc.RpcError:
        return False


def round_trips_ms(address: str, num_requests: int, pace_s: float) -> list[float]:
    """Milliseconds per round trip, one request at a time, `pace_s` of idle before each."""
    payload = os.urandom(PAYLOAD_BYTES)
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(METHOD)
        wait_until(lambda: _answers(call, payload), timeout_s=30, interval_s=0.1, message="relay chain answers")
        for _ in range(50):  # connections up, code paths warm
            call(payload, timeout=5)
        times_ms = []
        for _ in range(num_requests):
            if pace_s:
                time.sleep(pace_s)
            began = time.perf_counter()
            call(payload, timeout=5)
            times_ms.append((time.perf_counter() - began) * 1000)
        return times_ms


def one_run(num_requests: int) -> list[dict]:
    rows = []
    for num_hops in NUM_HOPS:
        with relay_chain(num_hops) as address:
            for pace, pace_s in PACES_S.items():
                times_ms = round_trips_ms(address, num_requests if pace_s < 0.2 else max(20, num_requests // 4), pace_s)
                rows.append({"num_hops": num_hops, "pace": pace, "num_requests": len(times_ms),
                             "p50_ms": round(statistics.median(times_ms), 3),
                             "p90_ms": round(statistics.quantiles(times_ms, n=10)[-1], 3),
                             "load_average_1m": round(os.getloadavg()[0], 2)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="round trips per chain and pace")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one run of a quarter of the requests")
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    args = parser.parse_args()
    num_runs, num_requests = (1, max(20, args.requests // 4)) if args.quick else (args.runs, args.requests)
    runs = [one_run(num_requests) for _ in range(num_runs)]
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run[i] for run in runs]
        rows.append((first["num_hops"], first["pace"], ", ".join(str(r["p50_ms"]) for r in same),
                     f"{statistics.median(r['p50_ms'] for r in same):.3f}", ", ".join(str(r["p90_ms"]) for r in same),
                     ", ".join(str(r["load_average_1m"]) for r in same)))
    print(markdown_table(["hops", "pace", "p50 ms, every run", "median p50 ms", "p90 ms, every run", "load"], rows))
    write_report(args.output, {"benchmark": "hop_floor", "payload_bytes": PAYLOAD_BYTES, "runs": runs})


if __name__ == "__main__":
    main()
