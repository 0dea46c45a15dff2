"""The harness's own CPU per request and per streamed token, and its schedule lag, on each target kind.

    .venv/bin/python -m bench.loadtest.bench_harness_cpu [--server stub|mesh] [--duration-s 10]
        [--classify-rps 500] [--generate-rps 100] [--output-len 50] [--token-interval-ms 10] [--runs 1]

--server stub (default): bench/loadtest/stub_server.py in its own process, a server that does no
work, so the box's cores go to the harness and the figures are the harness's: the issue's targets,
generator lag p99 under 5 ms at 500 classify/s and at 5 000 streamed tokens/s (100 streams/s x 50
tokens), on grpc:// and openai+http:// (streamed and whole). --server mesh: the toy mesh (scheduler,
toy classifier and generator workers, gateway with its HTTP port), every target kind it serves
(grpc, openai+https, kserve+grpc infer and stream, kserve+https), at rates the mesh can carry.

The runner is driven in this process, as `python -m loadtest run` drives it (uvloop). The figures:
this process's CPU time (time.process_time) over the run divided by the requests and by the
streamed tokens, and the generator's lag (how late it sent against its own schedule) p99 and max.
Each run records the load average at its start and how long the event loop's thread waited, runnable,
for a core the box gave to other processes (/proc/self/schedstat): on a shared box that wait, not
the harness's own work, is where lag comes from when the CPU share stays low.
Prints a table and writes bench/results/loadtest_harness_cpu.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvloop

from bench.harness.results import RESULTS_DIR, ROOT, write_report
from bench.harness.tables import markdown_table
from loadtest.runner import LoadRunner, MonotonicClock
from loadtest.scenario import parse_scenario
from loadtest.targets.factory import open_target
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_until

RESULTS_PATH = RESULTS_DIR / "loadtest_harness_cpu.json"
Run = tuple[str, str, object]  # name, target URL, scenario


def _scenario(kind: str, model: str, rate_rps: float, duration_s: float, output_len: int, stream: bool = True):
    if kind == "classify":
        klass = {"name": "c", "kind": "classify", "model": model, "deadline_ms": 10000,
                 "image": {"size_px": 32, "encoding": "png", "num_variants": 8}}
    else:
        klass = {"name": "g", "kind": "generate", "model": model, "deadline_ms": 30000, "prompt_len": 16,
                 "output_len": output_len, "stream": stream}
    return parse_scenario({"name": f"bench-{kind}", "duration_s": duration_s, "warmup_s": 1, "seed": 1,
                           "load": {"arrival": "poisson", "rate_rps": rate_rps},
                           "tenants": [{"api_key": "demo-key-alpha"}], "classes": [klass]})


async def _measure(url: str, scenario, ca_file: str) -> dict:
    clock = MonotonicClock()
    target = open_target(url, scenario, clock, "bench", ca_file)
    try:
        load_1m = os.getloadavg()[0]
        waited0 = _runqueue_wait_s()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = await LoadRunner(scenario, target, clock).run()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        waited_s = _runqueue_wait_s() - waited0
    finally:
        await target.close()
    ok = [r for r in result.records if r.ok]
    tokens = sum(r.num_output_tokens for r in ok)
    lags = sorted(result.lag_us)
    return {
        "target": url, "load_1m": round(load_1m, 2), "requests": len(result.records), "ok": len(ok), "tokens": tokens,
        "cpu_s": round(cpu_s, 3), "wall_s": round(wall_s, 2),
        "cpu_share": round(cpu_s / wall_s, 3),  # of one core
        # The event loop's thread, runnable but waiting for a core the box gave to others: lag it did not cause.
        "runqueue_wait_ms_per_s": round(waited_s * 1000 / wall_s, 1),
        "cpu_us_per_request": round(cpu_s * 1e6 / max(1, len(result.records)), 1),
        "cpu_us_per_token": round(cpu_s * 1e6 / tokens, 2) if tokens else None,
        "lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))] / 1000, 3) if lags else None,
        "lag_median_ms": round(statistics.median(lags) / 1000, 3) if lags else None,
        "lag_max_ms": round(lags[-1] / 1000, 3) if lags else None,
    }


def _runqueue_wait_s() -> float:
    """Seconds this process's main thread (the event loop's) has spent runnable but not running
    (/proc/self/schedstat: time on a CPU, time waiting on a run queue, timeslices; nanoseconds)."""
    with open("/proc/self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


@contextmanager
def _stub_runs(args) -> Iterator[list[Run]]:
    grpc_port, http_port = free_port(), free_port()
    server = subprocess.Popen([sys.executable, "-m", "bench.loadtest.stub_server", "--grpc-port", str(grpc_port),
                               "--http-port", str(http_port), "--token-interval-ms", str(args.token_interval_ms)],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        wait_until(lambda: server.stdout.readline().strip() == "READY", timeout_s=60, message="the stub server READY")
        grpc_url, openai_url = f"grpc://127.0.0.1:{grpc_port}", f"openai+http://127.0.0.1:{http_port}/v1"
        gen = ("generate", "tinylm", args.generate_rps, args.duration_s, args.output_len)
        yield [
            ("grpc classify", grpc_url, _scenario("classify", "digits", args.classify_rps, args.duration_s, 0)),
            ("grpc generate", grpc_url, _scenario(*gen)),
            ("openai stream", openai_url, _scenario(*gen)),
            ("openai whole", openai_url, _scenario(*gen, stream=False)),
        ]
    finally:
        server.terminate()
        server.wait(timeout=10)


@contextmanager
def _mesh_runs(args) -> Iterator[list[Run]]:
    http_port = free_port()
    with tempfile.TemporaryDirectory() as tmp, running_mesh(Path(tmp)) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        mesh.start_gateway("--http-port", str(http_port), "--max-in-flight", "100000")
        grpc_url, http = f"grpc://{mesh.gateway.address}", f"127.0.0.1:{http_port}"
        classify = ("classify", "toy-classifier", args.classify_rps, args.duration_s, 0)
        gen = ("generate", "toy-generator", args.generate_rps, args.duration_s, args.output_len)
        yield [
            ("grpc classify", grpc_url, _scenario(*classify)),
            ("grpc generate", grpc_url, _scenario(*gen)),
            ("openai stream", f"openai+https://{http}/v1", _scenario(*gen)),
            ("openai whole", f"openai+https://{http}/v1", _scenario(*gen, stream=False)),
            ("kserve grpc infer", f"kserve+grpc://{mesh.gateway.address}", _scenario(*classify)),
            ("kserve grpc stream", f"kserve+grpc://{mesh.gateway.address}", _scenario(*gen)),
            ("kserve http infer", f"kserve+https://{http}", _scenario(*classify)),
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", choices=("stub", "mesh"), default="stub")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--classify-rps", type=float, default=500.0)
    parser.add_argument("--generate-rps", type=float, default=100.0)
    parser.add_argument("--output-len", type=int, default=50)
    parser.add_argument("--token-interval-ms", type=float, default=10.0, help="stub: the gap between its tokens")
    parser.add_argument("--runs", type=int, default=1, help="rounds over every target (medians in the table)")
    parser.add_argument("--only", default="", help="comma-separated run names (e.g. 'grpc classify')")
    args = parser.parse_args()
    ca_file = str(session_tls.session_pki().ca_path) if args.server == "mesh" else ""
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    rows = []
    with (_stub_runs(args) if args.server == "stub" else _mesh_runs(args)) as runs:
        for round_index in range(args.runs):
            for name, url, scenario in runs:
                if only and name not in only:
                    continue
                figures = uvloop.run(_measure(url, scenario, ca_file))  # as `python -m loadtest run` runs
                rows.append({"run": name, "round": round_index, **figures})
                print(f"{name}: {figures}", flush=True)
    print(markdown_table(
        ["run", "load 1m", "requests", "tokens", "cpu share", "runq wait ms/s", "cpu us/req", "cpu us/token",
         "lag p99 ms", "lag max ms"],
        [[r["run"], r["load_1m"], r["requests"], r["tokens"], r["cpu_share"], r["runqueue_wait_ms_per_s"],
          r["cpu_us_per_request"], r["cpu_us_per_token"], r["lag_p99_ms"], r["lag_max_ms"]] for r in rows]))
    write_report(RESULTS_PATH, {"args": vars(args), "runs": rows})


if __name__ == "__main__":
    main()
