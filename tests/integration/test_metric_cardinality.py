"""Requests cannot grow the metric store: thousands of calls with made-up model names and tenant ids
leave the number of exported series where it was (issue 13, bounded metric cardinality).

One mesh for the module: each test counts the series of its own service before and after its flood,
and neither kills or reconfigures a process."""

from __future__ import annotations

import asyncio
import random
import string
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.request_metrics import MAX_TENANT_LABELS
from tools.testbed import session_tls
from tools.testbed.processes import ROOT, Mesh, free_port, running_mesh

pytestmark = [pytest.mark.integration, pytest.mark.slow]
# Made-up values after the first flood: each one new, eight times the scheduler's tenant-label budget, so a
# bound that leaked would show as thousands of series. 10 000 calls showed nothing more and cost ~35 s more
# CPU on the 2-core box.
NUM_CALLS = 8 * MAX_TENANT_LABELS
TENANTS = str(ROOT / "deploy" / "local" / "tenants.yaml")
PIXELS = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3))


def _num_series(port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(len(family.samples) for family in text_string_to_metric_families(text))


def _junk(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_lowercase + string.digits, k=12))


async def _flood(num_calls: int, one: Callable[[int], Awaitable[None]]) -> None:
    """`one(i)` for i in range(num_calls), 64 at a time."""
    semaphore = asyncio.Semaphore(64)

    async def bounded(i: int) -> None:
        async with semaphore:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(num_calls)))


async def _flood_scheduler(address: str, num_calls: int, seed: int) -> None:
    rng = random.Random(seed)
    async with session_tls.aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def one(i: int) -> None:
            # Half for a made-up model, half for the real one from a made-up tenant.
            model = _junk(rng) if i % 2 else "toy-classifier"
            request = scheduler_pb2.ScheduleClassifyRequest(
                request=gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=model), image=PIXELS),
                tenant=scheduler_pb2.TenantContext(tenant_id=_junk(rng)))
            try:
                await stub.Classify(request, timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED), exc

        await _flood(num_calls, one)


@dataclass
class _Served:
    mesh: Mesh
    scheduler_metrics_port: int
    gateway_metrics_port: int


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> _Served:
    scheduler_metrics_port, gateway_metrics_port = free_port(), free_port()
    with running_mesh(tmp_path_factory.mktemp("cardinality")) as mesh:
        mesh.start_scheduler("--metrics-port", str(scheduler_metrics_port))
        mesh.start_worker("toy-classifier")
        mesh.start_gateway("--metrics-port", str(gateway_metrics_port), "--tenants-file", TENANTS)
        yield _Served(mesh, scheduler_metrics_port, gateway_metrics_port)


def _series_before_and_after(flood: Callable[[str, int, int], Awaitable[None]], address: str,
                             metrics_port: int) -> tuple[int, int]:
    """The service's series after a first flood (it fills the fixed "_other" series and the tenant-label
    budget: 1 000 new tenants) and after NUM_CALLS more made-up calls."""
    asyncio.run(flood(address, 1_000, 1))
    before = _num_series(metrics_port)
    asyncio.run(flood(address, NUM_CALLS, 2))
    return before, _num_series(metrics_port)


def test_made_up_models_and_tenants_at_the_scheduler_add_no_series(served):
    before, after = _series_before_and_after(_flood_scheduler, served.mesh.scheduler.address,
                                             served.scheduler_metrics_port)
    print(f"scheduler series: {before} before, {after} after {NUM_CALLS} made-up calls")
    assert after == before


async def _flood_gateway(address: str, num_calls: int, seed: int) -> None:
    rng = random.Random(seed)
    async with session_tls.aio_channel(address) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> None:
            # Made-up keys (unauthenticated) and a real key with made-up models, alternately.
            key = "demo-key-alpha" if i % 2 else _junk(rng)
            request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=_junk(rng)), image=PIXELS)
            try:
                await stub.Classify(request, timeout=10, metadata=(("authorization", f"Bearer {key}"),))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                                      grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.RESOURCE_EXHAUSTED), exc

        await _flood(num_calls, one)


def test_made_up_models_and_keys_at_the_gateway_add_no_series(served):
    before, after = _series_before_and_after(_flood_gateway, served.mesh.gateway.address,
                                             served.gateway_metrics_port)
    print(f"gateway series: {before} before, {after} after {NUM_CALLS} made-up calls")
    assert after == before
