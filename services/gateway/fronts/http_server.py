"""The gateway's HTTP listener (--http-port): aiohttp on the gateway's own uvloop event loop.

HTTPS with the gateway's certificate when the gRPC port serves TLS, plaintext with --plaintext.
Client certificates as --tls-client-auth says: none (tenants bring API keys or tokens), optional
(asked for, verified against --tls-ca-file when sent) or require (a connection without one fails
its handshake). The certificate, key and CA files are looked at once a second; once they rotate
into a valid set a new context is built, and every new connection's handshake switches to it
(`_ContextSwitch`: the server name callback runs on every handshake, SNI or not). So a CA
removed from the bundle refuses its certificates on the next connection without a restart;
connections already open keep what their handshake verified.

`GET /health` (and HEAD) answers 200 with no body while the gateway serves, 503 otherwise, as vLLM, TGI and
SGLang answer it, for load balancers and probes that know OpenAI-style servers; KServe's /v2/health/* say
the same in KServe's shape.

Slow or silent clients cannot hold connections open: a connection that has not delivered a whole
request head within idle_timeout_s of opening (or of its last response) is closed, and a body
that has not fully arrived within body_timeout_s is answered 408 and its connection closed.
Requests aiohttp cannot parse (a header too long, a bad method or chunk size) are answered 400
by aiohttp and logged at DEBUG, not as ERROR with a traceback: anyone can send them.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from services.common import errors
from services.common.cert_files import DEFAULT_CHECK_INTERVAL_S, CertificateWatcher, PemMaterial, TlsFiles
from services.common.config import ConfigError
from services.gateway.fronts.cors import Cors
from services.gateway.fronts.kserve_http import PREFIX as KSERVE_PREFIX
from services.gateway.fronts.kserve_http import KServeHttp, kserve_errors
from services.gateway.fronts.openai_http import OpenAIFront, openai_errors
from services.gateway.fronts.server_timing import copy_to_server_timing

log = logging.getLogger(__name__)

# aiohttp's keepalive timer: it closes a connection only while no request is being handled, so it
# bounds both the wait for a request head (the first, or the next on a kept-alive connection) and a
# head trickled in byte by byte. Longer than clients keep idle pooled connections (aiohttp's 15 s,
# httpx's 5 s), so a client never reuses one the gateway is closing.
IDLE_TIMEOUT_S = 30.0
# The whole body, from the end of the head (nginx's client_body_timeout is 60 s between reads;
# the bodies here are at most --max-message-bytes).
BODY_TIMEOUT_S = 60.0


class _ClientProtocolErrors(logging.Filter):
    """Keeps aiohttp's refusals of unparseable requests (logged at ERROR with a traceback) out of the
    log, as one DEBUG line each: a client, not the gateway, was wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        log.debug("%s: %s", record.getMessage(), exc.message)
        return False


# The logger aiohttp's connections log to (instead of its own aiohttp.server).
_server_log = log.getChild("aiohttp")
_server_log.addFilter(_ClientProtocolErrors())


class HttpServer:
    def __init__(self, front: OpenAIFront, host: str, port: int, tls_files: TlsFiles | None,
                 max_body_bytes: int, shutdown_timeout_s: float = 10.0, kserve: KServeHttp | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                 client_cert: str = "none", ready: Callable[[], bool] = lambda: True,
                 cors_origins: Sequence[str] = ()) -> None:
        """kserve: the KServe v2 REST front (/v2/...), its errors in KServe's shape; the rest is OpenAI's.
        client_cert: none | optional | require (a client certificate, verified against tls_files.ca_path).
        ready: whether the gateway serves now (GET /health).
        cors_origins: origins whose browser pages may call (cors.py); none: no CORS."""
        if client_cert not in CLIENT_CERT_MODES:
            raise ValueError(f"client_cert must be one of {', '.join(CLIENT_CERT_MODES)}, got {client_cert!r}")
        if client_cert != "none" and (tls_files is None or not tls_files.ca_path):
            raise ConfigError(f"HTTP port: client certificates ({client_cert}) need TLS and --tls-ca-file to verify them")
        cors = Cors(cors_origins) if cors_origins else None
        middlewares = [_errors_by_protocol, _body_deadline(body_timeout_s)]
        app = web.Application(middlewares=[cors.preflight, *middlewares] if cors else middlewares,
                              client_max_size=max_body_bytes)
        if cors is not None:
            app.on_response_prepare.append(cors.on_response_prepare)
        app.add_routes(front.routes())
        app.add_routes([web.get("/health", _health(ready))])
        app.on_response_prepare.append(copy_to_server_timing)  # stages as browsers and load tools read them
        if kserve is not None:
            app.add_routes(kserve.routes())
        # handler_cancellation: on disconnect the generation is closed and its KV blocks freed upstream.
        # auto_decompress off: the fronts decode Content-Encoding themselves (json_body.decoded), so a
        # body that is not what its header says is a 400 naming it, not an aiohttp parser error.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=shutdown_timeout_s, keepalive_timeout=idle_timeout_s,
                                    auto_decompress=False, logger=_server_log)
        self._front = front
        self._host = host
        self._port = port
        self._tls_files = tls_files
        self._client_cert = client_cert
        self._ssl: _ContextSwitch | None = None
        self._rotation: asyncio.Task | None = None

    async def start(self) -> None:
        if self._tls_files is not None:
            watcher = CertificateWatcher(self._tls_files, time.monotonic)
            self._ssl = _ContextSwitch(_server_context(self._tls_files, watcher.current, self._client_cert))
            self._rotation = asyncio.create_task(self._follow_rotation(watcher), name="http-certificate")
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_port=True,
                           ssl_context=self._ssl.listener if self._ssl is not None else None)
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(f"cannot bind the HTTP port {self._host}:{self._port}: {exc}") from None
        log.info("OpenAI-compatible HTTP (/v1) and KServe v2 REST (/v2) on %s://%s:%d",
                 "https" if self._ssl else "http", self._host, self._port)

    async def close(self) -> None:
        if self._rotation is not None:
            self._rotation.cancel()
        await self._front.close()
        await self._runner.cleanup()

    async def _follow_rotation(self, watcher: CertificateWatcher) -> None:
        assert self._ssl is not None and self._tls_files is not None  # followed only when serving TLS
        while True:
            await asyncio.sleep(DEFAULT_CHECK_INTERVAL_S)
            material = watcher.poll()
            if material is not None:
                try:
                    self._ssl.current = _server_context(self._tls_files, material, self._client_cert)
                except ConfigError as exc:  # rotated again between the check and this read
                    log.warning("HTTP port keeps its certificate: %s", exc)
                    continue
                log.info("HTTP port certificate%s reloaded from %s",
                         " and client CA bundle" if self._client_cert != "none" else "", self._tls_files.cert_path)


def _health(ready: Callable[[], bool]):
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if ready() else 503)
    return health


@web.middleware
async def _errors_by_protocol(request: web.Request, handler) -> web.StreamResponse:
    """Refusals in the shape of the protocol the path belongs to (unknown paths get OpenAI's)."""
    path = request.path
    if path == KSERVE_PREFIX or path.startswith(KSERVE_PREFIX + "/"):
        return await kserve_errors(request, handler)
    return await openai_errors(request, handler)


def _body_deadline(timeout_s: float):
    """Reads each body within `timeout_s` (aiohttp keeps it: the handler's own read returns it at once)."""

    @web.middleware
    async def body_in_time(request: web.Request, handler) -> web.StreamResponse:
        if request.can_read_body:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                # A failed payload makes aiohttp close the connection after the 408 at once, instead of
                # first waiting up to its lingering time for the rest of the body.
                request.content.set_exception(TimeoutError("the request body did not arrive in time"))
                raise web.HTTPRequestTimeout() from None
            except RequestPayloadError as exc:  # a bad chunk size, a body cut short
                raise errors.InvalidArgument(f"the request body is malformed: {exc}") from None
        return await handler(request)

    return body_in_time


CLIENT_CERT_MODES = ("none", "optional", "require")
_VERIFY_MODE = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "require": ssl.CERT_REQUIRED}


class _ContextSwitch:
    """The listener's one SSLContext, whose server name callback (run on every handshake, with or
    without SNI) hands the connection the `current` context: certificate and client CAs can then
    change for new connections, where asyncio keeps the listener's context for good."""

    def __init__(self, first: ssl.SSLContext) -> None:
        # The listener is the first context itself: OpenSSL takes a connection's verify mode from it
        # before the callback runs, and every context here has the same mode (--tls-client-auth).
        self.current = first
        self.listener = first
        self.listener.sni_callback = self._switch

    def _switch(self, connection, server_name: str | None, listener_context: ssl.SSLContext) -> None:
        connection.context = self.current


def _server_context(files: TlsFiles, material: PemMaterial, client_cert: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(files.cert_path, files.key_path)
        if client_cert != "none" and material.ca_pem is not None:
            context.load_verify_locations(cadata=material.ca_pem.decode("ascii"))
    except (OSError, ssl.SSLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"HTTP port: cannot load {files.cert_path} / {files.key_path} / {files.ca_path}: "
                          f"{exc}") from None
    context.verify_mode = _VERIFY_MODE[client_cert]
    if client_cert != "none":
        # A resumed TLS session skips the certificate check and keeps the first handshake's peer
        # certificate, so a client whose CA left the bundle would go on resuming. TLS 1.3 without
        # tickets cannot resume; TLS 1.2 would still resume from the listener's session-id cache,
        # which Python cannot turn off: with client certificates the port speaks TLS 1.3 only.
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.options |= ssl.OP_NO_TICKET
        context.num_tickets = 0
    return context
