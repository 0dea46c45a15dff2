"""Undecodable request bytes answer INVALID_ARGUMENT on every calling convention (found by the
reflection-driven fuzz, tests/fuzz: grpc.aio answered UNKNOWN "Unexpected DecodeError")."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from services.common.request_decoding import RequestDecodingInterceptor

REQUEST = health_pb2.HealthCheckRequest
REPLY = health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
CORRUPT = b"\xff\xff\xff"  # a truncated varint tag
BAD_UTF8 = b"\x0a\x02\xc3\x28"  # field 1 (service, a string) holding invalid UTF-8


async def unary(request, context):
    assert isinstance(request, REQUEST)
    return REPLY


async def server_stream(request, context):
    assert isinstance(request, REQUEST)
    yield REPLY


async def read_all(requests, context):
    """Reader/writer style, as the scheduler's Attach and Submit: context.read() until EOF."""
    while (message := await context.read()) is not grpc.aio.EOF:
        assert isinstance(message, REQUEST)
    await context.write(REPLY)


async def iterate_all(requests, context):
    async for message in requests:
        assert isinstance(message, REQUEST)
    yield REPLY


HANDLERS = {
    "Unary": grpc.unary_unary_rpc_method_handler(unary, REQUEST.FromString, REPLY.SerializeToString),
    "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream, REQUEST.FromString, REPLY.SerializeToString),
    "Read": grpc.stream_stream_rpc_method_handler(read_all, REQUEST.FromString, REPLY.SerializeToString),
    "Iterate": grpc.stream_stream_rpc_method_handler(iterate_all, REQUEST.FromString, REPLY.SerializeToString),
}


@pytest.fixture
async def address():
    server = grpc.aio.server(interceptors=[RequestDecodingInterceptor()])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Fuzz", HANDLERS),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _call(channel: grpc.aio.Channel, method: str, messages: list[bytes]) -> grpc.StatusCode:
    path = f"/test.Fuzz/{method}"
    try:
        if method == "Unary":
            await channel.unary_unary(path)(messages[0], timeout=5)
        elif method == "ServerStream":
            [_ async for _ in channel.unary_stream(path)(messages[0], timeout=5)]
        else:
            call = channel.stream_stream(path)(timeout=5)
            for message in messages:
                await call.write(message)
            await call.done_writing()
            [_ async for _ in call]
    except grpc.aio.AioRpcError as exc:
        assert "not a valid message" in exc.details()
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", list(HANDLERS))
@pytest.mark.parametrize("bad", [CORRUPT, BAD_UTF8], ids=["corrupt", "bad-utf8"])
async def test_undecodable_request_answers_invalid_argument(address, method, bad):
    good = REQUEST(service="svc").SerializeToString()
    async with grpc.aio.insecure_channel(address) as channel:
        assert await _call(channel, method, [good]) == grpc.StatusCode.OK
        messages = [bad] if method in ("Unary", "ServerStream") else [good, bad]
        assert await _call(channel, method, messages) == grpc.StatusCode.INVALID_ARGUMENT
