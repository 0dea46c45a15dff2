"""The harness's own CPU per request and per streamed token, on each target kind, against the toy mesh.

    .venv/bin/python -m bench.loadtest.bench_harness_cpu [--duration-s 10] [--classify-rps 100]
                                                         [--generate-rps 20] [--output-len 50]

Starts one toy mesh (scheduler, toy classifier and generator workers, gateway with its HTTP
port) and drives it with the load test's own runner, in this process, once per target kind:
grpc:// classify and generate, openai+https:// streamed and whole, kserve+grpc:// infer and
stream, kserve+https:// infer. The figure is this process's CPU time (time.process_time: the
generator's, not the mesh's) over the run, divided by the requests and by the streamed tokens,
next to the generator's lag p99 (how late it sent against its own schedule). Prints a table and
writes bench/results/loadtest_harness_cpu.json. On a shared box the mesh competes for the cores,
so lag reflects the box; CPU time per request does not.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import uvloop

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.tables import markdown_table
from loadtest.runner import LoadRunner, MonotonicClock
from loadtest.scenario import parse_scenario
from loadtest.targets.factory import open_target
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh

RESULTS_PATH = RESULTS_DIR / "loadtest_harness_cpu.json"


def _scenario(kind: str, rate_rps: float, duration_s: float, output_len: int, stream: bool = True):
    if kind == "classify":
        klass = {"name": "c", "kind": "classify", "model": "toy-classifier", "deadline_ms": 10000,
                 "image": {"size_px": 32, "encoding": "png", "num_variants": 8}}
    else:
        klass = {"name": "g", "kind": "generate", "model": "toy-generator", "deadline_ms": 30000, "prompt_len": 16,
                 "output_len": output_len, "stream": stream}
    return parse_scenario({"name": f"bench-{kind}", "duration_s": duration_s, "warmup_s": 1, "seed": 1,
                           "load": {"arrival": "poisson", "rate_rps": rate_rps},
                           "tenants": [{"api_key": "demo-key-alpha"}], "classes": [klass]})


async def _measure(url: str, scenario, ca_file: str) -> dict:
    clock = MonotonicClock()
    target = open_target(url, scenario, clock, "bench", ca_file)
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        result = await LoadRunner(scenario, target, clock).run()
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        await target.close()
    ok = [r for r in result.records if r.ok]
    tokens = sum(r.num_output_tokens for r in ok)
    lags = sorted(result.lag_us)
    return {
        "target": url, "requests": len(result.records), "ok": len(ok), "tokens": tokens, "cpu_s": round(cpu_s, 3),
        "wall_s": round(wall_s, 2), "cpu_us_per_request": round(cpu_s * 1e6 / max(1, len(result.records)), 1),
        "cpu_us_per_token": round(cpu_s * 1e6 / tokens, 2) if tokens else None,
        "lag_p99_ms": round(lags[int(0.99 * (len(lags) - 1))] / 1000, 3) if lags else None,
        "lag_median_ms": round(statistics.median(lags) / 1000, 3) if lags else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--classify-rps", type=float, default=100.0)
    parser.add_argument("--generate-rps", type=float, default=20.0)
    parser.add_argument("--output-len", type=int, default=50)
    args = parser.parse_args()
    ca_file = str(session_tls.session_pki().ca_path)
    http_port = free_port()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, running_mesh(Path(tmp)) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        mesh.start_gateway("--http-port", str(http_port), "--max-in-flight", "100000")
        grpc_url, http = f"grpc://{mesh.gateway.address}", f"127.0.0.1:{http_port}"
        runs = [
            ("grpc classify", grpc_url, _scenario("classify", args.classify_rps, args.duration_s, 0)),
            ("grpc generate", grpc_url, _scenario("generate", args.generate_rps, args.duration_s, args.output_len)),
            ("openai stream", f"openai+https://{http}/v1",
             _scenario("generate", args.generate_rps, args.duration_s, args.output_len)),
            ("openai whole", f"openai+https://{http}/v1",
             _scenario("generate", args.generate_rps, args.duration_s, args.output_len, stream=False)),
            ("kserve grpc infer", f"kserve+grpc://{mesh.gateway.address}",
             _scenario("classify", args.classify_rps, args.duration_s, 0)),
            ("kserve grpc stream", f"kserve+grpc://{mesh.gateway.address}",
             _scenario("generate", args.generate_rps, args.duration_s, args.output_len)),
            ("kserve http infer", f"kserve+https://{http}", _scenario("classify", args.classify_rps, args.duration_s, 0)),
        ]
        for name, url, scenario in runs:
            figures = uvloop.run(_measure(url, scenario, ca_file))  # as `python -m loadtest run` runs
            rows.append({"run": name, **figures})
            print(f"{name}: {figures}", flush=True)
    print(markdown_table(["run", "requests", "ok", "tokens", "cpu us/req", "cpu us/token", "lag p99 ms"],
                         [[r["run"], r["requests"], r["ok"], r["tokens"], r["cpu_us_per_request"],
                           r["cpu_us_per_token"], r["lag_p99_ms"]] for r in rows]))
    write_report(RESULTS_PATH, {"args": vars(args), "runs": rows})


if __name__ == "__main__":
    main()
