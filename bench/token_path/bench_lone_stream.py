"""One tinylm stream at a time through a fresh mesh: the per-token cost of the hops, with nothing queued.

    .venv/bin/python -m bench.token_path.bench_lone_stream [--streams 30] [--tokens 100] [--runs 3] [--output PATH]

Starts a scheduler, a tinylm worker (1 thread, as bench_token_path's) and a gateway on 127.0.0.1,
then sends `--streams` Generate requests one after another (greedy, EOS ignored, `--tokens` each),
through the gateway and straight to the scheduler in turn. For each path and run: the end-to-end
p50 of a stream, its milliseconds per token, the scheduler's stage medians from the last chunk's
timings (compute = the worker's model steps; overhead = what no stage accounts for) and each
process's CPU per token. The in-process cost of the same steps is `bench.token_path.bench_step_cost`'s one-sequence
row; the difference is what the mesh adds. Prints a table, writes JSON (bench/results/lone_stream.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.harness.cpu import cpu_seconds
from bench.harness.mesh_ready import WORKER_ENV, wait_attached
from bench.harness.results import MODEL_REPO, RESULTS_DIR, write_report
from bench.harness.tables import markdown_table
from bench.token_path.e2e_tenant import E2E_API_KEY, E2E_TENANT
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tools.testbed.gateway_fixtures import write_tenants
from tools.testbed.processes import running_mesh

RESULTS_PATH = RESULTS_DIR / "lone_stream.json"
# (stage, the service that reports it) -> figure
STAGES = {(common_pb2.STAGE_COMPUTE, "worker"): "compute_ms", (common_pb2.STAGE_OVERHEAD, "scheduler"): "overhead_ms",
          (common_pb2.STAGE_SCHEDULER, "scheduler"): "scheduler_ms"}


def _request(index: int, tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="tinylm"), prompt=f"hello {index} world",
                                       sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True))


def _streams(call, make_request, metadata, num_streams: int) -> tuple[list[float], list[dict[str, float]]]:
    """Seconds per stream, and the scheduler's stages (ms) from each stream's last timings."""
    seconds, stages = [], []
    for index in range(num_streams):
        began = time.perf_counter()
        timings = None
        for reply in call(make_request(index), metadata=metadata, timeout=60):
            chunk = getattr(reply, "chunk", reply)
            if chunk.HasField("timings"):
                timings = chunk.timings
        seconds.append(time.perf_counter() - began)
        if timings is not None:
            stages.append({STAGES[s.stage, s.service]: s.duration_us / 1000 for s in timings.stages
                           if (s.stage, s.service) in STAGES})
    return seconds, stages


def one_run(num_streams: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-lone-stream-") as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        mesh.start_scheduler("--log-level", "WARNING")
        mesh.start_worker("tinylm", "--log-level", "WARNING", "--model-repository", str(MODEL_REPO),
                          "--num-threads", "1", "--max-num-seqs", "32", env=WORKER_ENV)
        wait_attached(mesh.scheduler.address, 1)
        mesh.start_gateway("--log-level", "WARNING", "--tenants-file",
                           str(write_tenants(Path(tmp) / "tenants.yaml", [E2E_TENANT])))
        pids = {p.name: p.proc.pid for p in mesh.processes}
        with grpc.insecure_channel(mesh.gateway.address) as gateway, \
                grpc.insecure_channel(mesh.scheduler.address) as scheduler:
            paths = {
                "gateway": (gateway_pb2_grpc.InferenceStub(gateway).Generate, lambda i: _request(i, tokens),
                            (("authorization", f"Bearer {E2E_API_KEY}"),)),
                "scheduler": (scheduler_pb2_grpc.SchedulerStub(scheduler).Generate,
                              lambda i: scheduler_pb2.ScheduleGenerateRequest(request=_request(i, tokens)), ()),
            }
            _streams(*paths["gateway"], 3)  # warm-up: first compiles, first connections
            figures = {}
            for name, (call, make_request, metadata) in paths.items():
                before = {process: cpu_seconds(pid) for process, pid in pids.items()}
                seconds, stages = _streams(call, make_request, metadata, num_streams)
                num_tokens = num_streams * tokens
                figures[name] = {
                    "e2e_p50_ms": round(statistics.median(seconds) * 1000, 1),
                    "ms_per_token": round(statistics.median(seconds) * 1000 / tokens, 3),
                    **{key: round(statistics.median(s[key] for s in stages), 2) for key in STAGES.values()
                       if stages and all(key in s for s in stages)},
                    "cpu_us_per_token": {process: round((cpu_seconds(pid) - before[process]) * 1e6 / num_tokens, 1)
                                         for process, pid in pids.items()},
                    "load_average": round(os.getloadavg()[0], 2),
                }
            return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS_PATH)
    parser.add_argument("--quick", action="store_true", help="one run (`make bench QUICK=1`)")
    args = parser.parse_args()
    if args.quick:
        args.runs = 1
    runs = [one_run(args.streams, args.tokens) for _ in range(args.runs)]
    rows = []
    for index, run in enumerate(runs):
        for path, f in run.items():
            cpu = ", ".join(f"{process} {us}" for process, us in f["cpu_us_per_token"].items())
            stages = f"{f.get('scheduler_ms', '-')} / {f.get('compute_ms', '-')} / {f.get('overhead_ms', '-')}"
            rows.append((index, path, str(f["e2e_p50_ms"]), str(f["ms_per_token"]), stages, cpu, str(f["load_average"])))
    print(markdown_table(["run", "path", "e2e p50 ms", "ms per token", "scheduler / compute / overhead ms (stages)",
                          "CPU us per token", "load"], rows))
    write_report(args.output, {"streams": args.streams, "tokens": args.tokens, "runs": runs})


if __name__ == "__main__":
    main()
