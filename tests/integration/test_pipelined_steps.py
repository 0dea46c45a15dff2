"""Pipelined steps through real processes: a scheduler with `--pipelined-steps on` (the default)
and one with `off`, each with a mock generator and a tinylm worker, stream exactly the same
tokens, indexes, finish reasons and usage for greedy and seeded requests with stop strings, EOS
and max_tokens mixed; only the first sends steps ahead (its pipelined-steps counter)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import scrape
from tools.testbed.generator_models import MOCK, mock_text
from tools.testbed.processes import free_port, running_mesh
from tools.testbed.scheduler_fixtures import scheduler_stub, tenant, wait_for_idle_kv, wait_for_workers

pytestmark = pytest.mark.integration

TINYLM = common_pb2.ModelRef(name="tinylm")
MOCK_PROFILE = "step_ms=2,block_size=16,max_seq_len=512"


@dataclass
class Scheduler:
    address: str
    metrics_port: int

    def num_pipelined_steps(self, model: str) -> float:
        return scrape(self.metrics_port).value("infermesh_scheduler_pipelined_steps_total", model=model)


@pytest.fixture(scope="module")
def schedulers(tmp_path_factory):
    with contextlib.ExitStack() as stack:
        found: dict[str, Scheduler] = {}
        workers = []
        for mode in ("on", "off"):
            mesh = stack.enter_context(running_mesh(tmp_path_factory.mktemp(f"pipelined-{mode}")))
            port = free_port()
            mesh.start_scheduler("--metrics-port", str(port), "--pipelined-steps", mode)
            found[mode] = Scheduler(mesh.scheduler.address, port)
            workers.append(mesh.start_worker(MOCK.name, "--mock-profile", MOCK_PROFILE, wait=False))
            workers.append(mesh.start_worker("tinylm", wait=False))
        for worker in workers:
            worker.wait_serving()
        for scheduler in found.values():
            with scheduler_stub(scheduler.address) as stub:
                wait_for_workers(stub, MOCK.ref, 1)
                wait_for_workers(stub, TINYLM, 1)
        yield found


def _requests(model: common_pb2.ModelRef, num: int) -> list[scheduler_pb2.ScheduleGenerateRequest]:
    requests = []
    for i in range(num):
        sampling = common_pb2.SamplingParams(max_tokens=1 + i * 7 % 40)
        if i % 2:
            sampling.temperature, sampling.seed = 0.9, 100 + i
        if i % 3 == 0:
            sampling.stop.append("e")
        prompt = f"Request {i}: the value of " if model == TINYLM else f"request {i} says "
        requests.append(scheduler_pb2.ScheduleGenerateRequest(
            request=gateway_pb2.GenerateRequest(model=model, prompt=prompt, sampling=sampling), tenant=tenant("t")))
    return requests


async def _streams(address: str, requests) -> list[tuple]:
    async with session_tls.aio_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        async def one(request) -> tuple:
            token_ids, indexes, text, last = [], [], "", None
            async for response in stub.Generate(request, timeout=60):
                chunk = response.chunk
                if chunk.token_ids:
                    indexes.append(chunk.index)
                token_ids.extend(chunk.token_ids)
                text += chunk.text
                last = chunk
            assert last is not None
            usage = (last.usage.prompt_tokens, last.usage.completion_tokens)
            return tuple(token_ids), tuple(indexes), text, last.finish_reason, usage

        return await asyncio.gather(*(one(r) for r in requests))


@pytest.mark.parametrize("model", [MOCK.ref, TINYLM], ids=["mock", "tinylm"])
def test_streams_match_pipelined_steps_off(schedulers, model):
    requests = _requests(model, 40)
    seen = {}
    for mode, scheduler in schedulers.items():
        before = scheduler.num_pipelined_steps(model.name)
        seen[mode] = asyncio.run(_streams(scheduler.address, requests))
        seen[mode + "_pipelined"] = scheduler.num_pipelined_steps(model.name) - before
        with scheduler_stub(scheduler.address) as stub:
            wait_for_idle_kv(stub, model)
    assert seen["on"] == seen["off"]
    assert seen["on_pipelined"] > 0 and seen["off_pipelined"] == 0
    finishes = {stream[3] for stream in seen["off"]}
    assert {common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP} <= finishes
    if model == MOCK.ref:
        for request, stream in zip(requests, seen["on"], strict=True):
            sampling = request.request.sampling
            if not sampling.stop:
                expected = mock_text(request.request.prompt, sampling.max_tokens, seed=sampling.seed)
                assert stream[2] == expected
