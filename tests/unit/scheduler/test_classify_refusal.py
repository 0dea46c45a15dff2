"""A refused Classify at the scheduler: the caller gets the error's status, message and retry hint,
and the call leaves no reference cycle behind (a flood is mostly refusals; with context.abort()
each one left ~50 objects for the cycle collector, whose full collections then paused the
event loop for 35-40 ms: docs/scheduler.md, "Fairness and the standing queue")."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from infermesh.v1 import scheduler_pb2_grpc
from services.common.status import PUSHBACK_KEY
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerServicer
from tests.support.reference_cycles import assert_refusals_leave_no_cycle
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
    await assert_refusals_leave_no_cycle(lambda: _refusal(stub))
