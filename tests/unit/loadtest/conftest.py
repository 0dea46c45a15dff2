"""A tiny fake gateway (infermesh.v1.Inference on grpc.aio) and record builders for the load-test tests."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from loadtest.records import OK, RequestRecord, StageSample
from loadtest.scenario import RequestKind


class FakeInference(gateway_pb2_grpc.InferenceServicer):
    """Answers after `compute_s`; the `stall_on_call`-th Classify (1-based) holds the server for
    `stall_s`, and every Classify arriving meanwhile waits for it, like a GC pause or a stuck batch."""

    def __init__(self, compute_s: float = 0.002, token_s: float = 0.002, stall_on_call: int = 0,
                 stall_s: float = 0.0, rejected_keys: frozenset[str] = frozenset(), skip_token_at: int = -1,
                 hang: bool = False) -> None:
        self.compute_s = compute_s
        self.token_s = token_s
        self.stall_on_call = stall_on_call
        self.stall_s = stall_s
        self.rejected_keys = rejected_keys
        self.skip_token_at = skip_token_at  # Generate: chunk index jumps by 2 here (a lost token)
        self.hang = hang  # Classify never answers
        self.num_classify = 0
        self.max_concurrent = 0
        self._concurrent = 0
        self.num_generate = 0
        self._stall_until_s = 0.0

    async def _admit(self, context) -> float:
        key = dict(context.invocation_metadata()).get("authorization", "").removeprefix("Bearer ")
        if key in self.rejected_keys:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant quota exceeded for {key}")
        return time.perf_counter()

    async def Classify(self, request, context):
        start_s = await self._admit(context)
        self.num_classify += 1
        self._concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self._concurrent)
        try:
            return await self._classify(request, start_s)
        finally:
            self._concurrent -= 1

    async def _classify(self, request, start_s: float):
        if self.hang:
            await asyncio.Event().wait()
        if self.num_classify == self.stall_on_call:
            self._stall_until_s = start_s + self.stall_s
        if self._stall_until_s > start_s:
            await asyncio.sleep(self._stall_until_s - start_s)
        queued_us = round((time.perf_counter() - start_s) * 1e6)
        await asyncio.sleep(self.compute_s)
        total_us = round((time.perf_counter() - start_s) * 1e6)
        return gateway_pb2.ClassifyResponse(
            request_id=request.request_id,
            model=common_pb2.ModelRef(name=request.model.name, version="1"),
            labels=[common_pb2.Label(label="3", index=3, score=0.9)],
            timings=common_pb2.Timings(total_us=total_us, stages=[
                common_pb2.StageTiming(stage=common_pb2.STAGE_ADMISSION, duration_us=20, service="gateway"),
                common_pb2.StageTiming(stage=common_pb2.STAGE_QUEUE_WAIT, duration_us=queued_us, service="scheduler"),
                common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=total_us - queued_us - 20,
                                       service="worker"),
                common_pb2.StageTiming(stage=common_pb2.STAGE_GATEWAY, duration_us=total_us, service="gateway"),
            ]),
        )

    async def Generate(self, request, context) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        start_s = await self._admit(context)
        self.num_generate += 1
        num_tokens = request.sampling.max_tokens or 4
        ttft_us = 0
        for i in range(num_tokens):
            await asyncio.sleep(self.token_s)
            if i == 0:
                ttft_us = round((time.perf_counter() - start_s) * 1e6)
            index = i + 1 if i >= self.skip_token_at >= 0 else i
            yield gateway_pb2.GenerateResponse(request_id=request.request_id, token_ids=[97], text="a", index=index)
        total_us = round((time.perf_counter() - start_s) * 1e6)
        yield gateway_pb2.GenerateResponse(
            request_id=request.request_id, index=num_tokens, finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt), completion_tokens=num_tokens),
            ttft_us=ttft_us,
            timings=common_pb2.Timings(total_us=total_us, stages=[
                common_pb2.StageTiming(stage=common_pb2.STAGE_PREFILL, duration_us=ttft_us, service="worker"),
                common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=total_us - ttft_us,
                                       service="worker"),
            ]))

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="digits", version="1"),
                                  kind=common_pb2.MODEL_KIND_CLASSIFIER, ready=True),
            gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name="tinylm", version="1"),
                                  kind=common_pb2.MODEL_KIND_GENERATOR, ready=True),
        ])


async def start_fake_gateway(servicer: FakeInference) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def fake_gateway():
    """Starts fake gateways on free ports; stops every one at teardown."""
    servers: list[grpc.aio.Server] = []

    async def start(**options) -> tuple[FakeInference, str]:
        servicer = FakeInference(**options)
        server, address = await start_fake_gateway(servicer)
        servers.append(server)
        return servicer, address

    yield start
    for server in servers:
        await server.stop(grace=None)


def make_record(seq: int = 0, latency_s: float = 0.01, **over) -> RequestRecord:
    """A successful classify record scheduled at seq * 10 ms, with simple stage timings."""
    scheduled_s = over.pop("scheduled_s", seq * 0.01)
    fields = dict(
        seq=seq, class_name="classify-small", kind=RequestKind.CLASSIFY, tenant="alpha", priority="standard",
        scheduled_s=scheduled_s, sent_s=scheduled_s, done_s=scheduled_s + latency_s, status=OK, measured=True,
        stages=(StageSample("queue_wait", "scheduler", round(latency_s * 0.3e6)),
                StageSample("compute", "worker", round(latency_s * 0.6e6))),
        server_total_us=round(latency_s * 0.95e6),
    )
    fields.update(over)
    return RequestRecord(**fields)


@contextlib.contextmanager
def fake_gateway_in_thread(**options):
    """A fake gateway on its own event loop in a thread, for tests that drive the blocking CLI."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servicer = FakeInference(**options)
    server, address = asyncio.run_coroutine_threadsafe(start_fake_gateway(servicer), loop).result(timeout=10)
    try:
        yield servicer, address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(grace=None), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


@pytest.fixture
async def fake_openai():
    """Starts fake OpenAI HTTP servers on free ports; stops every one at teardown."""
    from tests.unit.loadtest.fake_openai import FakeOpenAI, start_fake_openai

    runners = []

    async def start(**options) -> tuple[FakeOpenAI, str]:
        server = FakeOpenAI(**options)
        runner, url = await start_fake_openai(server)
        runners.append(runner)
        return server, url

    yield start
    for runner in runners:
        await runner.cleanup()
