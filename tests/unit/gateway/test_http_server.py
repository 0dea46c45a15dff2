"""The HTTP listener against raw sockets: slow and silent clients are cut off, malformed requests are
refused without a traceback in the log, bodies are decoded or refused in the fronts' error shapes.

A real aiohttp listener on a free 127.0.0.1 port, plaintext, with short timeouts; the fronts get a
fake generator and tenants, so every answer here comes from the HTTP layer itself.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
import zlib

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.fronts.http_server import HttpServer
from services.gateway.fronts.kserve_http import KServeHttp
from services.gateway.fronts.openai_http import OpenAIFront
from services.gateway.tenants.directory import TenantConfig, TenantDirectory, hash_api_key
from tests.unit.gateway.conftest import make_tenant
from tools.testbed.processes import free_port

KEY = "good-key"
TIMEOUT_S = 0.5
# A closed connection is seen well within this; without the timeouts it would stay open for an hour.
CLOSED_WITHIN_S = TIMEOUT_S + 2.0


# The tenants' own check: both HTTP fronts hand it the Authorization header(s), joined (fronts/caller.py).
_TENANTS = TenantDirectory(TenantConfig((make_tenant(api_key_sha256=(hash_api_key(KEY),)),), "test"))


def _authenticate(authorization: str | None) -> None:
    _TENANTS.authenticate(authorization)


class _EchoCore:
    """Generates the prompt back, in one chunk."""

    async def generate(self, request: gateway_pb2.GenerateRequest, caller, *, further_choice: bool = False,
                       on_admitted=None):
        _authenticate(caller.authorization)
        yield gateway_pb2.GenerateResponse(text=request.prompt, finish_reason=common_pb2.FINISH_REASON_LENGTH)


class _KServeCore:
    def authenticate(self, authorization: str | None) -> None:
        _authenticate(authorization)

    async def model_metadata(self, name: str, version: str, authorization: str | None):
        _authenticate(authorization)
        raise errors.NotFound(f"model '{name}' is not served here")


async def _list_models(authorization: str | None, timeout_s: float) -> gateway_pb2.ListModelsResponse:
    _authenticate(authorization)
    return gateway_pb2.ListModelsResponse()


@pytest.fixture
async def port():
    port = free_port()
    server = HttpServer(OpenAIFront(_EchoCore(), _list_models, _authenticate), "127.0.0.1", port, None,
                        max_body_bytes=1 << 16, kserve=KServeHttp(_KServeCore(), ready=lambda: True),
                        idle_timeout_s=TIMEOUT_S, body_timeout_s=TIMEOUT_S)
    await server.start()
    yield port
    await server.close()


async def _exchange(port: int, data: bytes, within_s: float = CLOSED_WITHIN_S) -> tuple[bytes, float]:
    """Everything the server sends after `data`, up to its close, and how long that took (fails past within_s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    started = time.monotonic()
    try:
        writer.write(data)
        async with asyncio.timeout(within_s):
            received = await reader.read()
        return received, time.monotonic() - started
    finally:
        writer.close()


def _reply(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def _post(path: str, body: bytes, *headers: str, key: str | None = KEY) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Connection: close", f"Content-Length: {len(body)}", *headers]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


COMPLETION = json.dumps({"model": "m", "prompt": "hello"}).encode()

# ------------------------------------------------------------------------------------ timeouts


@pytest.mark.parametrize("sent", [
    b"",  # connected, never sent a byte
    b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n",  # a head that never ends
])
async def test_a_connection_without_a_whole_request_head_is_closed_after_the_idle_timeout(port, sent):
    received, took_s = await _exchange(port, sent)
    assert received == b"" and took_s >= TIMEOUT_S * 0.9


async def test_an_idle_kept_alive_connection_is_closed_after_the_idle_timeout(port):
    received, took_s = await _exchange(port, f"GET /v1/models HTTP/1.1\r\nHost: test\r\n"
                                             f"Authorization: Bearer {KEY}\r\n\r\n".encode())
    assert received.startswith(b"HTTP/1.1 200 OK") and received.endswith(b'"data":[]}')
    assert took_s >= TIMEOUT_S * 0.9


async def test_a_body_that_stalls_is_408_and_its_connection_closed(port):
    received, _ = await _exchange(port, _post("/v1/completions", COMPLETION)[:-5])
    assert _reply(received) == (408, {"error": {"message": "POST /v1/completions: Request Timeout",
                                                "type": "invalid_request_error", "param": None, "code": "408"}})


# ------------------------------------------------------------------------------------ malformed HTTP


@pytest.mark.parametrize("sent", [
    b"GET /v1/models HTTP/1.1\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(200)) + b"\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-A: b\r\n folded\r\n\r\n",
    b"G@T /v1/models HTTP/1.1\r\nHost: test\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
])
async def test_a_malformed_request_is_400_and_logged_without_a_traceback(port, sent, caplog):
    caplog.set_level(logging.DEBUG, logger="services.gateway.fronts.http_server")
    received, _ = await _exchange(port, sent)
    assert received.startswith(b"HTTP/1.0 400 Bad Request")
    assert [r for r in caplog.records if r.levelno >= logging.INFO or r.exc_info] == []
    assert any(r.getMessage().startswith("Error handling request from 127.0.0.1") for r in caplog.records)


# ------------------------------------------------------------------------------------ bodies


@pytest.mark.parametrize(("headers", "body", "message"), [
    (("Content-Encoding: gzip",), COMPLETION, "the body is not valid gzip"),
    (("Content-Encoding: br",), COMPLETION,
     "Content-Encoding 'br' is not supported: send the body as identity, gzip or deflate"),
    (("Content-Type: application/json; charset=bogus-xyz",), COMPLETION,
     "the Content-Type's charset 'bogus-xyz' is not a known text encoding (send UTF-8)"),
    ((), b"[" * 1000 + b"]" * 1000, "the request body is nested too deeply (more than 64 levels of arrays and objects)"),
])
async def test_a_body_that_cannot_be_decoded_is_400_in_the_openai_shape(port, caplog, headers, body, message):
    received, _ = await _exchange(port, _post("/v1/completions", body, *headers))
    assert _reply(received) == (400, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                                "code": None}})
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_a_compressed_body_is_decompressed(port, encoding, compress):
    received, _ = await _exchange(port, _post("/v1/completions", compress(COMPLETION), f"Content-Encoding: {encoding}"))
    status, reply = _reply(received)
    assert (status, reply["choices"][0]["text"]) == (200, "hello")


async def test_a_body_over_the_limit_once_decompressed_is_413(port):
    received, _ = await _exchange(port, _post("/v1/completions", gzip.compress(b" " * (1 << 17)),
                                              "Content-Encoding: gzip"))
    assert _reply(received)[0] == 413


async def test_kserve_refuses_an_undecodable_body_in_its_shape(port):
    received, _ = await _exchange(port, _post("/v2/models/m/infer", b"[" * 1000, "Content-Encoding: gzip"))
    assert _reply(received) == (400, {"error": "the body is not valid gzip"})
    received, _ = await _exchange(port, _post("/v2/repository/index", b"[" * 1000 + b"]" * 1000))
    assert _reply(received) == (400, {"error": "the request body is nested too deeply (more than 64 levels of "
                                               "arrays and objects)"})


# ------------------------------------------------------------------------------------ Authorization


async def test_two_authorization_headers_are_401_even_when_one_is_good(port):
    # The same check and message as gRPC metadata sent twice (tenants/directory.py); until issue 32 the
    # HTTP fronts had their own check, which said "more than one Authorization header".
    expected = "more than one authorization value: send one 'Bearer <key>'"
    received, _ = await _exchange(port, _post("/v1/completions", COMPLETION, "Authorization: Bearer bad"))
    assert _reply(received) == (401, {"error": {"message": expected, "type": "authentication_error", "param": None,
                                                "code": "invalid_api_key"}})
    received, _ = await _exchange(port, b"GET /v2/models/m HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
                                        b"Authorization: Bearer bad\r\nAuthorization: Bearer good-key\r\n\r\n")
    assert _reply(received) == (401, {"error": expected})
    received, _ = await _exchange(port, _post("/v2/models/m/infer", b"{}", "Authorization: Bearer bad"))
    assert _reply(received) == (401, {"error": expected})


# ------------------------------------------------------------------------------------ /health


async def test_health_is_200_while_the_gateway_serves_and_503_once_it_does_not():
    serving = [True]
    health_port = free_port()
    server = HttpServer(OpenAIFront(_EchoCore(), _list_models, _authenticate), "127.0.0.1", health_port, None,
                        max_body_bytes=1 << 16, kserve=KServeHttp(_KServeCore(), ready=lambda: serving[0]),
                        ready=lambda: serving[0])
    await server.start()
    try:
        for method in ("GET", "HEAD"):  # no key: load balancers and probes have none
            request = f"{method} /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n".encode()
            received, _ = await _exchange(health_port, request)
            assert received.startswith(b"HTTP/1.1 200 OK") and received.endswith(b"\r\n\r\n"), received
        serving[0] = False
        received, _ = await _exchange(health_port, b"GET /health HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n")
        assert received.startswith(b"HTTP/1.1 503 "), received
    finally:
        await server.close()


# ------------------------------------------------------------------------------------ CORS

APP = "https://chat.example.com"


@pytest.fixture
async def cors_port(request):
    cors_port = free_port()
    server = HttpServer(OpenAIFront(_EchoCore(), _list_models, _authenticate), "127.0.0.1", cors_port, None,
                        max_body_bytes=1 << 16, kserve=KServeHttp(_KServeCore(), ready=lambda: True),
                        cors_origins=request.param)
    await server.start()
    yield cors_port
    await server.close()


def _preflight(origin: str) -> bytes:
    return (f"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nOrigin: {origin}\r\n"
            "Access-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n"
            "\r\n").encode()


def _headers(raw: bytes) -> tuple[int, dict[str, str]]:
    head = raw.partition(b"\r\n\r\n")[0].decode().split("\r\n")
    return int(head[0].split(" ")[1]), {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}


@pytest.mark.parametrize("cors_port", [(APP,)], indirect=True)
async def test_a_listed_origin_passes_the_preflight_and_reads_the_reply(cors_port):
    status, headers = _headers((await _exchange(cors_port, _preflight(APP)))[0])
    assert status == 204
    assert headers["access-control-allow-origin"] == APP
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in headers["access-control-allow-methods"]
    received, _ = await _exchange(cors_port, _post("/v1/completions", COMPLETION, f"Origin: {APP}"))
    status, headers = _headers(received)
    assert status == 200 and headers["access-control-allow-origin"] == APP and headers["vary"] == "Origin"
    assert "x-request-id" in headers["access-control-expose-headers"]
    streamed = json.dumps({"model": "m", "prompt": "hello", "stream": True}).encode()
    status, headers = _headers((await _exchange(cors_port, _post("/v1/completions", streamed, f"Origin: {APP}")))[0])
    assert (status, headers["content-type"], headers["access-control-allow-origin"]) == (200, "text/event-stream", APP)
    # A refusal reaches the page too, so its script can read why.
    status, headers = _headers((await _exchange(cors_port, _post("/v1/completions", b"{", f"Origin: {APP}")))[0])
    assert status == 400 and headers["access-control-allow-origin"] == APP


@pytest.mark.parametrize("cors_port", [(APP,)], indirect=True)
async def test_another_origin_is_refused_the_preflight_and_gets_no_cors_headers(cors_port):
    status, headers = _headers((await _exchange(cors_port, _preflight("https://evil.example")))[0])
    assert status == 403 and "access-control-allow-origin" not in headers
    received, _ = await _exchange(cors_port, _post("/v1/completions", COMPLETION, "Origin: https://evil.example"))
    status, headers = _headers(received)
    assert status == 200 and "access-control-allow-origin" not in headers  # served; the browser hides it


@pytest.mark.parametrize("cors_port", [("*",)], indirect=True)
async def test_any_origin_when_configured_so(cors_port):
    status, headers = _headers((await _exchange(cors_port, _preflight("http://localhost:3000")))[0])
    assert status == 204 and headers["access-control-allow-origin"] == "*"


async def test_without_origins_there_is_no_cors(port):
    status, headers = _headers((await _exchange(port, _preflight(APP)))[0])
    assert status == 405 and "access-control-allow-origin" not in headers
    status, headers = _headers((await _exchange(port, _post("/v1/completions", COMPLETION, f"Origin: {APP}")))[0])
    assert status == 200 and "access-control-allow-origin" not in headers
