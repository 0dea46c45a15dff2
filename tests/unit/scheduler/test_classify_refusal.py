"""A refused Classify at the scheduler: the caller gets the error's status, message and retry hint,
and the call leaves no reference cycle behind (a flood is mostly refusals; with context.abort()
each one left ~50 objects for the cycle collector, whose full collections then paused the
event loop for 35-40 ms: docs/scheduler.md, "Fairness and the standing queue")."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator

import grpc
import pytest

from infermesh.v1 import scheduler_pb2_grpc
from services.common.errors import InfermeshError
from services.common.status import PUSHBACK_KEY
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerServicer
from tools.testbed.scheduler_fixtures import classify_request


@pytest.fixture
async def servicer_stub() -> AsyncIterator[tuple[SchedulerServicer, scheduler_pb2_grpc.SchedulerStub]]:
    servicer = SchedulerServicer(SchedulerConfig())
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield servicer, scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await server.stop(None)


async def _refusal(stub: scheduler_pb2_grpc.SchedulerStub) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Classify(classify_request("light"), timeout=5)
    return caught.value


async def test_a_refusal_carries_its_code_message_and_retry_hint(servicer_stub) -> None:
    servicer, stub = servicer_stub
    unknown = await _refusal(stub)
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert "toy-classifier" in unknown.details()
    assert not any(key == PUSHBACK_KEY for key, _ in unknown.trailing_metadata() or ())

    servicer._draining = True  # what drain() sets first
    draining = await _refusal(stub)
    assert draining.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in draining.details()
    assert (PUSHBACK_KEY, "1") in tuple(draining.trailing_metadata() or ())  # "at once"


async def test_a_refusal_leaves_no_reference_cycle(servicer_stub) -> None:
    _, stub = servicer_stub
    await _refusal(stub)  # first-call set-up out of the way
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(20):
            await _refusal(stub)
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    # The server's side only: this test's client keeps its own errors' tracebacks.
    servicer_frames = [o for o in garbage if type(o).__name__ == "frame" and "services/" in o.f_code.co_filename]
    server_errors = [type(o).__name__ for o in garbage
                     if isinstance(o, InfermeshError | grpc.aio.AbortError)]
    assert servicer_frames == [] and server_errors == []
