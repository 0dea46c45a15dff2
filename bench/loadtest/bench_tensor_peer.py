"""A brought ONNX CNN through the mesh against the same model under Ray Serve with `@serve.batch`
(issue 34's peer), with the same closed-loop KServe gRPC driver and payload.

    .venv/bin/python -m bench.loadtest.bench_tensor_peer [--clients 32] [--seconds 8] [--sequential 300]

The CNN, its import and the driver are bench/worker/bench_tensor_batching.py's: 3x32x32 in, 10
scores out, ONNX Runtime on one thread; `--clients` callers each sending batch-1 ModelInfer back to
back, then one caller sequentially (batch-1 latency). The mesh batches up to 32 rows (2 ms queue
delay); the peer (bench/harness/ray_serve_peer.py, .venv-rayserve: run
tests/integration/test_loadtest_peer.py once to build it) batches up to 32 with a 5 ms wait, both
stacking same-shape rows on dim 0 and running the worker's own tensor runtime. Both on this
machine's cores with the driver. Prints a table and writes bench/results/tensor_peer.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.tables import markdown_table
from bench.loadtest.bench_peer_ab import stop_peer
from bench.worker.bench_tensor_batching import (
    BATCHED,
    MODEL,
    closed_loop,
    export_cnn,
    import_cnn,
    sequential_ms,
    with_mesh,
)
from tools.testbed.processes import ROOT, free_port, wait_until

RESULTS_PATH = RESULTS_DIR / "tensor_peer.json"
PEER_PYTHON = ROOT / ".venv-rayserve" / "bin" / "python"


async def _measure(address: str, clients: int, seconds: float, num_sequential: int) -> dict:
    load = await closed_loop(address, clients, seconds)
    return {**load, "sequential_ms": await sequential_ms(address, num_sequential)}


@contextlib.contextmanager
def running_peer(tmp: Path, repository: Path) -> Iterator[str]:
    """The Ray Serve peer serving MODEL from `repository`, its KServe gRPC address yielded once it is
    READY; stopped on exit, with whatever of Ray outlived it."""
    http_port, grpc_port = free_port(), free_port()
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    log = tmp / "peer.log"
    with open(log, "wb") as out:
        peer = subprocess.Popen([str(PEER_PYTHON), "-m", "bench.harness.ray_serve_peer", "--port", str(http_port),
                                 "--grpc-port", str(grpc_port), "--tensor-model", MODEL,
                                 "--tensor-model-repo", str(repository), "--temp-dir", ray_dir],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: peer.poll() is not None or "READY" in log.read_text(errors="replace"), 300,
                   message="the Ray Serve peer READY")
        if peer.poll() is not None:
            raise SystemExit(f"the peer exited:\n{log.read_text(errors='replace')[-3000:]}")
        yield f"127.0.0.1:{grpc_port}"
    finally:
        stop_peer(peer)
        shutil.rmtree(ray_dir, ignore_errors=True)


def with_peer(tmp: Path, repository: Path, measure):
    with running_peer(tmp, repository) as address:
        return asyncio.run(measure(address))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--sequential", type=int, default=300)
    args = parser.parse_args()
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run tests/integration/test_loadtest_peer.py once to build it")

    def measure(address: str):
        return _measure(address, args.clients, args.seconds, args.sequential)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repository = tmp / "repo"
        import_cnn(export_cnn(tmp), repository)
        results = {}
        for name, run in (("mesh", lambda d: with_mesh(d, repository, BATCHED, measure)),
                          ("ray serve", lambda d: with_peer(d, repository, measure))):
            (tmp / name.replace(" ", "-")).mkdir()
            results[name] = {"load_1m": round(os.getloadavg()[0], 2), **run(tmp / name.replace(" ", "-"))}
            print(f"{name}: {results[name]}", flush=True)
    ratio = results["mesh"]["requests_per_s"] / results["ray serve"]["requests_per_s"]
    print(markdown_table(("server", "load 1m", "requests/s", "p50 ms", "p99 ms", "shed", "batch-1 sequential ms"),
                         [(k, v["load_1m"], v["requests_per_s"], v["p50_ms"], v["p99_ms"], v["num_shed"],
                           v["sequential_ms"]) for k, v in results.items()]))
    print(f"\nmesh / Ray Serve: {ratio:.2f}x requests/s ({args.clients} closed-loop clients, batch 1)")
    write_report(RESULTS_PATH, {"clients": args.clients, "seconds": args.seconds, "results": results,
                                "mesh_over_peer": ratio})


if __name__ == "__main__":
    main()
