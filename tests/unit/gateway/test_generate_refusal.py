"""A refused Generate at the gateway: the caller gets the error's status, message and retry hint, and the
call leaves no reference cycle behind. Under overload most Generate calls are refusals (bench_slo: ~750/s
at 4x on tinylm); with context.abort() each left its handler's frames in a cycle for the collector, whose
full collections pause every stream through the gateway (the scheduler's Classify had the same:
docs/scheduler.md, "Where the flooded tail came from")."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.errors import ResourceExhausted
from services.common.status import PUSHBACK_KEY
from services.gateway.fronts.servicer import InferenceServicer
from tests.support.reference_cycles import assert_refusals_leave_no_cycle


class RefusingCore:
    """A GenerateCore that refuses every request as admission would, before any chunk."""

    async def generate(self, request, caller, *, further_choice: bool = False) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        raise ResourceExhausted("overloaded: model 'm' would start a critical stream in 900 ms at best",
                                retry_after_s=0.7)
        yield gateway_pb2.GenerateResponse()  # an async generator, as GenerateCore.generate is


class OneChunkThenFailing:
    """A stream that fails after its first chunk (a mid-stream error keeps the chunk and gets the status)."""

    async def generate(self, request, caller, *, further_choice: bool = False) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        yield gateway_pb2.GenerateResponse(token_ids=[7])
        raise ResourceExhausted("scheduler gone", retry_after_s=0.1)


async def _stub(core) -> AsyncIterator[gateway_pb2_grpc.InferenceStub]:
    server = grpc.aio.server()
    gateway_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(core, None, None), server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.InferenceStub(channel)
    finally:
        await server.stop(None)


@pytest.fixture
async def refusing() -> AsyncIterator[gateway_pb2_grpc.InferenceStub]:
    async for stub in _stub(RefusingCore()):
        yield stub


REQUEST = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="m"), prompt="hi")


async def _refusal(stub: gateway_pb2_grpc.InferenceStub) -> tuple[list, grpc.aio.AioRpcError]:
    chunks = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for chunk in stub.Generate(REQUEST, timeout=5):
            chunks.append(chunk)
    return chunks, caught.value


async def test_a_refusal_carries_its_code_message_and_retry_hint(refusing) -> None:
    chunks, error = await _refusal(refusing)
    assert chunks == []
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "would start a critical stream" in error.details()
    assert (PUSHBACK_KEY, "700") in tuple(error.trailing_metadata() or ())


async def test_an_error_after_a_chunk_ends_the_stream_with_its_status() -> None:
    async for stub in _stub(OneChunkThenFailing()):
        chunks, error = await _refusal(stub)
        assert [list(c.token_ids) for c in chunks] == [[7]]
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.details() == "scheduler gone"


async def test_a_refusal_leaves_no_reference_cycle(refusing) -> None:
    await assert_refusals_leave_no_cycle(lambda: _refusal(refusing))
