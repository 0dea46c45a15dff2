"""A brought ONNX CNN through the mesh: dynamic batching on vs off at saturation, and the mesh's
overhead per request against the model called directly.

    .venv/bin/python -m bench.worker.bench_tensor_batching [--quick] [--clients 32] [--seconds 8]

The CNN (3x32x32 in, two conv blocks of 32 and 64 channels, 10 scores out) is exported here with
torch.onnx.export and imported as `infermesh models import` does; one worker serves it on ONNX
Runtime with one thread. Each mesh is started fresh (scheduler, that worker, a gateway, plaintext
on 127.0.0.1):

* batching: a closed loop of `--clients` KServe gRPC callers, each sending batch-1 ModelInfer
  requests back to back for `--seconds` (one the gateway's adaptive limit sheds is counted, and
  its caller backs off 50 ms, as the pushback says), once with the scheduler batching up to 32 rows
  (--max-batch-size 32, --max-queue-delay-ms 2) and once with every batch one row
  (--max-batch-size 1). Requests/s and latency p50/p99 for each, and the ratio.
* overhead: one caller, batch 1, sequential, through the mesh, against the same ONNX session
  called in this process (one thread): mean latency per request and the difference.

The client, the gateway, the scheduler and the worker share this machine's cores, so the figures
are the whole mesh's on one box. Prints tables and writes bench/results/tensor_batching.json.
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
import numpy as np

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.stats import quantile
from bench.harness.tables import markdown_table
from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from tools.testbed.processes import running_mesh

RESULTS_PATH = RESULTS_DIR / "tensor_batching.json"
AUTH = ()  # the gateway admits anonymous callers here: the figures are the path's, not the tenants'
MODEL = "bench-cnn"
BATCHED = ("--max-batch-size", "32", "--max-queue-delay-ms", "2")
UNBATCHED = ("--max-batch-size", "1", "--max-queue-delay-ms", "0")


def export_cnn(directory: Path) -> Path:
    import torch
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10), nn.Softmax(dim=-1),
    ).eval()
    path = directory / "cnn.onnx"
    torch.onnx.export(net, (torch.randn(2, 3, 32, 32),), str(path), dynamo=False, input_names=["x"],
                      output_names=["probs"], dynamic_axes={"x": {0: "batch"}, "probs": {0: "batch"}})
    return path


def import_cnn(source: Path, repository: Path) -> None:
    from services.worker.repository.tensor_import import ImportRequest, import_tensor_model

    import_tensor_model(ImportRequest(source, MODEL, "1", repository, max_batch_size=32))


def request(x: np.ndarray) -> kserve.ModelInferRequest:
    infer = kserve.ModelInferRequest(model_name=MODEL)
    infer.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    infer.raw_input_contents.append(x.tobytes())
    return infer


async def closed_loop(address: str, num_clients: int, seconds: float) -> dict:
    x = np.random.default_rng(0).standard_normal((1, 3, 32, 32), np.float32)
    message = request(x)
    latencies_s: list[float] = []
    num_shed = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        await stub.ModelInfer(message, timeout=30, metadata=AUTH)  # warm: the route and the worker's link

        async def client(stop_at: float) -> None:
            nonlocal num_shed
            while time.perf_counter() < stop_at:
                began = time.perf_counter()
                try:
                    await stub.ModelInfer(message, timeout=30, metadata=AUTH)
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise
                    num_shed += 1  # the gateway's adaptive limit shed it: back off as its pushback says
                    await asyncio.sleep(0.05)
                    continue
                if time.perf_counter() <= stop_at:
                    latencies_s.append(time.perf_counter() - began)

        began = time.perf_counter()
        await asyncio.gather(*(client(began + seconds) for _ in range(num_clients)))
    return {"requests_per_s": len(latencies_s) / seconds, "num_requests": len(latencies_s), "num_shed": num_shed,
            "p50_ms": quantile(latencies_s, 0.5) * 1e3, "p99_ms": quantile(latencies_s, 0.99) * 1e3}


async def sequential_ms(address: str, num_requests: int) -> float:
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32), np.float32)
    message = request(x)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        for _ in range(20):
            await stub.ModelInfer(message, timeout=30, metadata=AUTH)
        times_s = []
        for _ in range(num_requests):
            began = time.perf_counter()
            await stub.ModelInfer(message, timeout=30, metadata=AUTH)
            times_s.append(time.perf_counter() - began)
    return statistics.fmean(times_s) * 1e3


def direct_ms(repository: Path, num_requests: int) -> float:
    from services.worker.repository.loader import load_model

    model = load_model(repository, MODEL, "1", num_threads=1).tensor
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32), np.float32)
    for _ in range(20):
        model.run({"x": x})
    began = time.perf_counter()
    for _ in range(num_requests):
        model.run({"x": x})
    return (time.perf_counter() - began) / num_requests * 1e3


def with_mesh(tmp: Path, repository: Path, scheduler_args: tuple[str, ...], measure):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    with running_mesh(tmp, env=env, tls=False) as mesh:
        mesh.start_scheduler(*scheduler_args)
        mesh.start_worker(MODEL, "--model-repository", str(repository), "--num-threads", "1")
        mesh.start_gateway("--allow-anonymous")
        return asyncio.run(measure(mesh.gateway.address))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 s per load, 200 sequential requests")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--sequential", type=int, default=1000)
    args = parser.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    num_sequential = 200 if args.quick else args.sequential
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        repository = root / "repo"
        import_cnn(export_cnn(root), repository)
        load = {}
        for name, scheduler_args in (("batching on", BATCHED), ("batching off", UNBATCHED)):
            (root / name.replace(" ", "-")).mkdir()
            load[name] = with_mesh(root / name.replace(" ", "-"), repository, scheduler_args,
                                   lambda address: closed_loop(address, args.clients, seconds))
        (root / "overhead").mkdir()
        mesh_ms = with_mesh(root / "overhead", repository, BATCHED, lambda a: sequential_ms(a, num_sequential))
        alone_ms = direct_ms(repository, num_sequential)
    speedup = load["batching on"]["requests_per_s"] / load["batching off"]["requests_per_s"]
    print(markdown_table(("batching", "requests/s", "p50 ms", "p99 ms", "shed"),
                         [(k, v["requests_per_s"], v["p50_ms"], v["p99_ms"], v["num_shed"]) for k, v in load.items()]))
    print(f"\nbatching on / off: {speedup:.2f}x requests/s ({args.clients} closed-loop clients, batch 1)")
    print(markdown_table(("batch 1, sequential", "ms per request"),
                         [("direct (ONNX Runtime, 1 thread)", alone_ms), ("through the mesh", mesh_ms),
                          ("mesh overhead", mesh_ms - alone_ms)]))
    write_report(RESULTS_PATH, {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "quick": args.quick, "clients": args.clients, "seconds": seconds,
        "load": load, "batching_speedup": speedup,
        "direct_ms": alone_ms, "mesh_ms": mesh_ms, "mesh_overhead_ms": mesh_ms - alone_ms,
    })


if __name__ == "__main__":
    main()
