"""The identity interceptor keeps every handler kind working for allowed peers and refuses the others
(in-process grpc.aio server with mTLS from tools/dev_ca.py; method names borrowed from the scheduler)."""

from __future__ import annotations

import grpc
import pytest

from services.common.authz import IdentityInterceptor
from services.common.config import ServerSettings
from services.common.identity import IdentityPolicy
from services.common.tls import plan, server_credentials
from tools.dev_ca import write_service_certs

_SERVICE = "infermesh.v1.Scheduler"


async def _unary(request: bytes, context) -> bytes:
    return request + b"!"


async def _async_stream(request: bytes, context):
    for i in range(3):
        yield bytes([i])


def _sync_stream(request: bytes, context):
    yield b"sync"


async def _reader_writer(requests, context) -> None:
    async for request in requests:
        await context.write(request.upper())


HANDLERS = grpc.method_handlers_generic_handler(_SERVICE, {
    "GetPressure": grpc.unary_unary_rpc_method_handler(_unary),
    "Generate": grpc.unary_stream_rpc_method_handler(_async_stream),
    "ListModels": grpc.unary_stream_rpc_method_handler(_sync_stream),
    "Attach": grpc.stream_stream_rpc_method_handler(_reader_writer),
})


@pytest.fixture
async def server(tmp_path):
    certs = write_service_certs(tmp_path)
    files = certs["scheduler"]
    tls = plan(ServerSettings(tls_cert_file=str(files.cert_path), tls_key_file=str(files.key_path),
                              tls_ca_file=str(files.ca_path)), "scheduler")
    server = grpc.aio.server(interceptors=[IdentityInterceptor(tls.identity_policy or IdentityPolicy())])
    server.add_generic_rpc_handlers((HANDLERS,))
    credentials, _watcher = server_credentials(tls)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    yield port, certs
    await server.stop(0)


def _channel(port: int, certs, identity: str) -> grpc.aio.Channel:
    files = certs[identity]
    credentials = grpc.ssl_channel_credentials(files.ca_path.read_bytes(), files.key_path.read_bytes(),
                                               files.cert_path.read_bytes())
    return grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials)


async def test_allowed_peers_get_every_handler_kind_unchanged(server):
    port, certs = server
    async with _channel(port, certs, "gateway") as channel:
        assert await channel.unary_unary(f"/{_SERVICE}/GetPressure")(b"hi", timeout=5) == b"hi!"
        assert [m async for m in channel.unary_stream(f"/{_SERVICE}/Generate")(b"", timeout=5)] == [
            b"\x00", b"\x01", b"\x02"]
        assert [m async for m in channel.unary_stream(f"/{_SERVICE}/ListModels")(b"", timeout=5)] == [b"sync"]
    async with _channel(port, certs, "worker") as channel:
        call = channel.stream_stream(f"/{_SERVICE}/Attach")(iter([b"a", b"b"]), timeout=5)
        assert [m async for m in call] == [b"A", b"B"]


@pytest.mark.parametrize(("identity", "method"), [
    ("worker", "Generate"), ("worker", "ListModels"), ("gateway", "Attach"), ("scheduler", "GetPressure"),
])
async def test_refused_peers_get_permission_denied_before_the_handler_runs(server, identity, method):
    port, certs = server
    async with _channel(port, certs, identity) as channel:
        if method == "Attach":
            call = channel.stream_stream(f"/{_SERVICE}/{method}")(iter([b"a"]), timeout=5)
        elif method == "GetPressure":
            call = channel.unary_unary(f"/{_SERVICE}/{method}")(b"", timeout=5)
        else:
            call = channel.unary_stream(f"/{_SERVICE}/{method}")(b"", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if method == "GetPressure":
                await call
            else:
                [m async for m in call]
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert caught.value.details().startswith(f"peer spiffe://infermesh/{identity} may not call /{_SERVICE}/{method}")


async def test_unknown_methods_stay_unimplemented(server):
    port, certs = server
    async with _channel(port, certs, "gateway") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await channel.unary_unary(f"/{_SERVICE}/NoSuchMethod")(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
