"""A scheduler and its workers as processes, and the generate streams the scheduler benchmarks send them.

bench_scheduler, bench_generate_fairness and bench_prefix_cache drive the scheduler's own gRPC API
(no gateway) through a `Cluster`.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import cpu as harness_cpu
from bench.harness.mesh_ready import WORKER_ENV, wait_attached
from bench.harness.results import MODEL_REPO
from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from tools.testbed.processes import free_port, running_mesh

# One compute thread per worker: the machine's cores are shared with the scheduler and this client.


CORPUS = (
    "The quick brown fox jumps over the lazy dog while the scheduler batches requests. "
    "A list is not the same as a tuple, and a string is a sequence of characters. "
    "Every worker dials the scheduler and runs the steps it is given, one after another. "
)


@dataclass
class Cluster:
    address: str
    metrics_url: str
    pids: dict[str, int] = field(default_factory=dict)
    channel: grpc.aio.Channel | None = None

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system) each process has used so far."""
        return {name: harness_cpu.cpu_seconds(pid) for name, pid in {**self.pids, "client": os.getpid()}.items()}

    @property
    def stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        return scheduler_pb2_grpc.SchedulerStub(self.channel)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }


@contextmanager
def cluster(scheduler_args: list[str], workers: list[tuple[str, list[str]]],
            scheduler_module: str = "") -> Iterator[Cluster]:
    """A scheduler and its workers as processes; waits until every worker is attached.
    `scheduler_module`: run instead of services.scheduler (bench.scheduler.static_batching, the baseline)."""
    metrics_port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-scheduler-") as tmp, running_mesh(Path(tmp), tls=False) as mesh:
        mesh.start_scheduler("--log-level", "WARNING", "--metrics-port", str(metrics_port), *scheduler_args,
                             module=scheduler_module)
        for model, args in workers:
            mesh.start_worker(model, "--log-level", "WARNING", *args, env=WORKER_ENV)
        wait_attached(mesh.scheduler.address, len(workers))
        yield Cluster(mesh.scheduler.address, f"http://127.0.0.1:{metrics_port}/metrics",
                      {p.name: p.proc.pid for p in mesh.processes})


def repository_model(name: str) -> bool:
    return (MODEL_REPO / name / "1" / "manifest.json").exists()


def tenant(tenant_id: str) -> scheduler_pb2.TenantContext:
    return scheduler_pb2.TenantContext(tenant_id=tenant_id, priority=common_pb2.PRIORITY_STANDARD, weight=1)


def with_channel(target: Cluster, body):
    """Runs `body(target)` on a fresh event loop with an open channel to the scheduler."""

    async def main():
        async with grpc.aio.insecure_channel(target.address) as channel:
            target.channel = channel
            try:
                return await body(target)
            finally:
                target.channel = None

    return uvloop.run(main())


@dataclass
class StreamResult:
    num_tokens: int = 0
    ttft_s: float = math.nan
    done_s: float = math.nan
    code: str = "OK"
    token_times_s: list[float] = field(default_factory=list)
    worker_compute_s: float = 0.0


def generate_request(model: str, prompt: str, max_tokens: int, who: str = "bench") -> scheduler_pb2.ScheduleGenerateRequest:
    return scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name=model), prompt=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=7)),
        tenant=tenant(who))


async def stream(stub, request, began_s: float, keep_times: bool = False, timeout_s: float = 120.0) -> StreamResult:
    result = StreamResult()
    try:
        async for response in stub.Generate(request, timeout=timeout_s):
            chunk = response.chunk
            now = time.perf_counter()
            if chunk.token_ids:
                if result.num_tokens == 0:
                    result.ttft_s = now - began_s
                result.num_tokens += len(chunk.token_ids)
                if keep_times:
                    result.token_times_s.append(now)
            if chunk.finish_reason:
                result.worker_compute_s = sum(s.duration_us for s in chunk.timings.stages
                                              if s.stage == common_pb2.STAGE_COMPUTE) / 1e6
    except grpc.aio.AioRpcError as exc:
        result.code = exc.code().name
    result.done_s = time.perf_counter() - began_s
    return result


def prompt_text(rng: random.Random, length: int) -> str:
    start = rng.randrange(len(CORPUS) - 1)
    return (CORPUS[start:] + CORPUS * (1 + length // len(CORPUS)))[:length]


def declared_max_num_seqs(model: str) -> int:
    """Running sequences the model's worker declares (its manifest's envelope; the toy's is 32)."""
    if model == "toy-generator":
        return 32
    manifest = json.loads((MODEL_REPO / model / "1" / "manifest.json").read_text())
    return manifest["envelope"]["max_num_seqs"]
