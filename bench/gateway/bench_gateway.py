"""Gateway CPU per admitted and per rejected request, and rejects/s when one tenant floods it.

    .venv/bin/python -m bench.gateway.bench_gateway [--num-admitted 2000] [--num-rejected 10000] [--concurrency 16]

Starts a toy mesh (scheduler, toy classifier with no compute, gateway with a
tenants file) and drives the gateway's public Classify with a grpc.aio client
in this process. The gateway's CPU time is read from /proc/<pid>/stat (user +
system, clock ticks) before and after each phase, minus its idle rate
(pressure poller, tenants watcher) measured first; divided by the number of
requests it gives CPU microseconds per request. Phases:

  admitted            valid key, served end to end (gateway -> scheduler -> worker)
  rejected: quota     one tenant flooding past its request quota (RESOURCE_EXHAUSTED)
  rejected: bad key   unknown API key (UNAUTHENTICATED)

Each mesh runs twice: with no span exporter configured (the default: the
gateway then makes no spans, only passes trace context on) and with
`parentbased_traceidratio` at 1% (production tracing: spans are made, 1% kept). The same client also drives a bare grpc.aio server (uvloop) whose
handler only aborts with RESOURCE_EXHAUSTED: the per-RPC transport floor any
Python gRPC server pays before its handler runs. "Above floor" ratios compare
the gateway's own work: (rejected - floor) / (admitted - floor). The floor runs
twice: aborting with a bare status, and with the status a quota refusal sends
(`grpc-retry-pushback-ms` and google.rpc.RetryInfo in `grpc-status-details-bin`).

Rejects/s is the gateway's answer rate during the flood; the client in this
process shares the machine's cores, so it is a lower bound. The issue's
target: a rejected request costs well under a tenth of an admitted one.

Prints a table and writes ``bench/results/gateway.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.gateway.classify_load import drive
from bench.harness.cpu import CLOCK_TICKS_PER_S, busy_cpu_s, cpu_seconds, idle_rates
from bench.harness.results import RESULTS_DIR, write_report
from services.gateway.tenants.directory import hash_api_key
from tools.testbed.processes import free_port, running_mesh, wait_until

RESULTS_PATH = RESULTS_DIR / "gateway.json"
BENCH_KEY, FLOOD_KEY = "bench-key", "flood-key"
TENANTS_YAML = f"""
tenants:
  - id: bench
    api_key_sha256: ["{hash_api_key(BENCH_KEY)}"]
    priority: critical
    allowed_models: "*"
    quotas: {{requests_per_s: 1000000, requests_burst: 1000000, tokens_per_s: 1000000, tokens_burst: 1000000,
              max_in_flight: 100000}}
  - id: flood
    api_key_sha256: ["{hash_api_key(FLOOD_KEY)}"]
    priority: standard
    allowed_models: "*"
    quotas: {{requests_per_s: 1, requests_burst: 1, tokens_per_s: 1000, tokens_burst: 1000, max_in_flight: 100}}
"""


SAMPLING = {
    "no span exporter": {},
    "1% of traces sampled": {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
}
# A gRPC server that does nothing but refuse: the transport cost under every gateway answer.
FLOOR_SERVER = """
import sys, grpc, uvloop
from infermesh.v1 import gateway_pb2_grpc
from services.common import errors, status
RICH = sys.argv[2:] == ["rich"]
class Refuse(gateway_pb2_grpc.InferenceServicer):
    async def Classify(self, request, context):
        if RICH:  # what the gateway's quota refusal sends: pushback header and google.rpc.RetryInfo
            await status.abort(context, errors.ResourceExhausted("over quota", retry_after_s=0.1))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over quota",
                            trailing_metadata=(("grpc-retry-pushback-ms", "100"),))
async def main():
    server = grpc.aio.server()
    gateway_pb2_grpc.add_InferenceServicer_to_server(Refuse(), server)
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()
uvloop.run(main())
"""


@dataclass(frozen=True)
class PhaseResult:
    phase: str
    num_requests: int
    num_ok: int
    codes: dict[str, int]
    wall_s: float
    gateway_cpu_s: float
    cpu_us_per_request: float
    requests_per_s: float




def measure(phase: str, pid: int, address: str, api_key: str, num_requests: int, concurrency: int,
            idle_cpu_per_s: float) -> PhaseResult:
    cpu_before = cpu_seconds(pid)
    codes, wall_s = asyncio.run(drive(address, api_key, num_requests, concurrency))
    cpu_s = busy_cpu_s(pid, cpu_before, idle_cpu_per_s, wall_s)
    return PhaseResult(
        phase=phase,
        num_requests=num_requests,
        num_ok=codes.get("OK", 0),
        codes=codes,
        wall_s=round(wall_s, 3),
        gateway_cpu_s=round(cpu_s, 3),
        cpu_us_per_request=round(cpu_s / num_requests * 1e6, 1),
        requests_per_s=round(num_requests / wall_s, 1),
    )


def grpc_floor(num_requests: int, concurrency: int, rich: bool = False) -> PhaseResult:
    """The floor server's CPU per refusal; `rich`: refusing with the gateway's status details."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(port), *(["rich"] if rich else [])])
    try:
        address = f"127.0.0.1:{port}"
        wait_until(lambda: asyncio.run(drive(address, "", 1, 1))[0].get("RESOURCE_EXHAUSTED") == 1, timeout_s=30,
                   interval_s=0.2, message="floor server up")
        asyncio.run(drive(address, "", 200, concurrency))
        return measure("floor + RetryInfo" if rich else "grpc.aio floor", server.pid, address, "", num_requests, concurrency, 0.0)
    finally:
        server.kill()
        server.wait()


def run_mesh(env: dict[str, str], num_admitted: int, num_rejected: int, concurrency: int, idle_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as tmp_dir, running_mesh(Path(tmp_dir), env, tls=False) as mesh:
        tenants = Path(tmp_dir) / "tenants.yaml"
        tenants.write_text(TENANTS_YAML, encoding="utf-8")
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_gateway("--tenants-file", str(tenants), "--log-level", "WARNING")
        pid, address = mesh.gateway.proc.pid, mesh.gateway.address
        asyncio.run(drive(address, BENCH_KEY, 200, concurrency))  # warm up channels, caches, code paths
        idle_cpu_per_s = idle_rates({"gateway": pid}, idle_s)["gateway"]
        phases = [
            measure("admitted", pid, address, BENCH_KEY, num_admitted, concurrency, idle_cpu_per_s),
            measure("rejected: quota", pid, address, FLOOD_KEY, num_rejected, concurrency, idle_cpu_per_s),
            measure("rejected: bad key", pid, address, "no-such-key", num_rejected, concurrency, idle_cpu_per_s),
        ]
    return {"idle_gateway_cpu_ms_per_s": round(idle_cpu_per_s * 1000, 2), "phases": [asdict(p) for p in phases]}


def ratios(phases: list[dict], floor_us: float) -> dict:
    admitted_us = phases[0]["cpu_us_per_request"]
    return {
        p["phase"]: {
            "of_admitted": round(p["cpu_us_per_request"] / admitted_us, 3),
            "above_floor": round((p["cpu_us_per_request"] - floor_us) / (admitted_us - floor_us), 3),
        }
        for p in phases[1:]
    }


def run(num_admitted: int, num_rejected: int, concurrency: int, idle_s: float) -> dict:
    floor = grpc_floor(num_rejected, concurrency)
    floor_rich = grpc_floor(num_rejected, concurrency, rich=True)
    runs = {}
    for label, env in SAMPLING.items():
        result = run_mesh(env, num_admitted, num_rejected, concurrency, idle_s)
        result["rejected_ratios"] = ratios(result["phases"], floor.cpu_us_per_request)
        runs[label] = result
    return {
        "benchmark": "gateway",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "settings": {"num_admitted": num_admitted, "num_rejected": num_rejected, "concurrency": concurrency,
                     "clock_ticks_per_s": CLOCK_TICKS_PER_S},
        "grpc_floor": asdict(floor),
        "grpc_floor_retry_info": asdict(floor_rich),
        "runs": runs,
    }


def print_table(results: dict) -> None:
    floor = results["grpc_floor"]
    print(f"{'tracing':<21} {'phase':<18} {'requests':>8} {'ok':>6} {'CPU us/req':>11} {'req/s':>8} "
          f"{'/admitted':>9} {'above floor':>11}")
    for label, run_ in results["runs"].items():
        for p in run_["phases"]:
            ratio = run_["rejected_ratios"].get(p["phase"], {})
            print(f"{label:<21} {p['phase']:<18} {p['num_requests']:>8} {p['num_ok']:>6} "
                  f"{p['cpu_us_per_request']:>11.1f} {p['requests_per_s']:>8.1f} "
                  f"{ratio.get('of_admitted', ''):>9} {ratio.get('above_floor', ''):>11}")
    for row in (floor, results["grpc_floor_retry_info"]):
        print(f"{'-':<21} {row['phase']:<18} {row['num_requests']:>8} {row['num_ok']:>6} "
              f"{row['cpu_us_per_request']:>11.1f} {row['requests_per_s']:>8.1f}")
    quota_us = results["runs"]["no span exporter"]["phases"][1]["cpu_us_per_request"]
    print(f"issue 11's target: a quota refusal <= 1.3x the floor; now {quota_us / floor['cpu_us_per_request']:.2f}x "
          f"(the floor refusing with RetryInfo: {results['grpc_floor_retry_info']['cpu_us_per_request'] / floor['cpu_us_per_request']:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-admitted", type=int, default=2000)
    parser.add_argument("--num-rejected", type=int, default=10000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=2.0, help="how long the idle CPU rate is measured")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests")
    args = parser.parse_args()
    if args.quick:
        args.num_admitted, args.num_rejected = args.num_admitted // 4, args.num_rejected // 4
    results = run(args.num_admitted, args.num_rejected, args.concurrency, args.idle_s)
    print_table(results)
    write_report(RESULTS_PATH, results)


if __name__ == "__main__":
    main()
