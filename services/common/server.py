"""One bootstrap for every service: grpc.aio on uvloop, health, reflection, metrics, tracing, drain.

A service supplies the `Service` protocol; `run()` owns the process lifecycle:

    start: bind, serve health NOT_SERVING, `service.start()` (which marks itself
           SERVING when ready: the worker only after load, warm-up and golden check)
    SIGTERM/SIGINT: health NOT_SERVING at once, serve on for `drain_notice_ms` (clients
           watching health move off) and then until grpc core has handed over every call it
           queued before (services/common/call_backlog.py), `service.drain(grace)`, stop the
           server with the rest of the grace period, `service.close()`, flush spans.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import ssl
import sys
import time
from collections.abc import Callable
from typing import Protocol, cast

import grpc
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from prometheus_client import Gauge, start_http_server

from services.common import build_info, tls
from services.common.authz import IdentityInterceptor
from services.common.call_backlog import STOP_RESERVE_S, serve_backlog
from services.common.cert_files import DEFAULT_CHECK_INTERVAL_S
from services.common.config import ConfigError, ServerSettings
from services.common.log_context import configure_logging
from services.common.metrics_tls import RotatingMetricsCertificate
from services.common.request_decoding import RequestDecodingInterceptor
from services.common.telemetry import setup_tracing

log = logging.getLogger(__name__)


class Health:
    """The standard grpc.health.v1 service, set for the server and each named service."""

    def __init__(self, service_names: tuple[str, ...]) -> None:
        self.servicer = _ListingHealthServicer(self)
        self._names = ("", *service_names)
        self.serving = False
        self._draining = False

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if not self._draining:  # the stock servicer ignores sets after its graceful shutdown too
            self.serving = serving
        for name in self._names:
            await self.servicer.set(name, status)

    async def enter_drain(self) -> None:
        self.serving = False
        self._draining = True
        await self.servicer.enter_graceful_shutdown()

    def statuses(self) -> dict[str, int]:
        """Every name Check answers for, with its status."""
        status = health_pb2.HealthCheckResponse.SERVING if self.serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return dict.fromkeys(self._names, status)


class _ListingHealthServicer(HealthServicer):
    """The stock aio servicer plus List: grpc.health.v1 has it (reflection lists it), the aio servicer
    leaves it to the generated base class, which raises NotImplementedError (UNKNOWN to the caller)."""

    def __init__(self, health: Health) -> None:
        super().__init__()
        self._health = health

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status) for name, status in self._health.statuses().items()
        })


class Service(Protocol):
    # Fully qualified gRPC service names, for health and reflection.
    service_names: tuple[str, ...]

    def register(self, server: grpc.aio.Server) -> None: ...

    async def start(self, health: Health) -> None: ...

    async def drain(self, grace_s: float) -> None: ...

    async def close(self) -> None: ...


def freeze_long_lived() -> None:
    """Moves every object alive now out of the cyclic collector's generations (after a full collection), so later
    full collections no longer walk them. Called once a service has made what lives as long as the process
    (modules, protobuf descriptors, the service; a worker's model): under a classify flood each gen-2 collection
    took 35-40 ms of the scheduler's event loop, ~7 ms frozen (docs/scheduler.md, "Fairness and the standing
    queue"); a model worker's final collection at exit took 0.8-1.8 s of CPU after its last log line."""
    gc.collect()
    gc.freeze()


def server_options(settings: ServerSettings) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", settings.max_message_bytes),
        ("grpc.max_send_message_length", settings.max_message_bytes),
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", settings.keepalive_min_ping_interval_ms),
    ]


async def serve(service_name: str, settings: ServerSettings, service: Service) -> None:
    provider = setup_tracing(service_name)
    health = Health(service.service_names)
    tls_plan = tls.plan(settings, service_name)
    tls.configure_client_tls(tls_plan.files)
    # The identity check runs first: a refused caller learns nothing about how its bytes parse.
    interceptors: list[grpc.aio.ServerInterceptor] = []
    if tls_plan.identity_policy:
        interceptors.append(IdentityInterceptor(tls_plan.identity_policy))
    # It also counts the calls handed to handlers, which a drain with a notice watches.
    handed = RequestDecodingInterceptor()
    interceptors.append(handed)
    server = grpc.aio.server(options=server_options(settings), interceptors=interceptors)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    reflection.enable_server_reflection(
        (*service.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    service.register(server)
    port = _add_port(server, settings, tls_plan)
    _report_tls(service_name, tls_plan)
    build_info.export(service_name)
    metrics_rotation = asyncio.create_task(_follow_rotation(_start_metrics(settings, tls_plan)))
    await health.set_serving(False)
    await server.start()
    log.info("listening on %s:%d", settings.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(service.start(health))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        failure = starting.exception()
        log.error("start failed: %s", failure)
        await server.stop(0)
        provider.shutdown()
        if isinstance(failure, ConfigError):
            raise failure  # run() exits 2 with the reason: nothing a restart would fix
        raise SystemExit(1)
    await stopped

    log.info("draining for up to %.1fs", settings.drain_grace_s)
    began = time.monotonic()
    starting.cancel()
    await health.enter_drain()
    if settings.drain_notice_ms > 0:
        # Health Watch streams have just seen NOT_SERVING: clients with client-side health checking
        # take this server out of their picks and send new calls elsewhere. Serving on meanwhile
        # means no call reaches it as server.stop() sends GOAWAY, which grpc core would cancel
        # (grpc/grpc#41785) rather than fail with a retryable UNAVAILABLE. The same holds for calls sent
        # before the notice and still queued in grpc core, so the server serves on until those are handed
        # over too, leaving the calls it then runs STOP_RESERVE_S of the grace at least.
        log.info("serving on for the %.0f ms drain notice before stopping", settings.drain_notice_ms)
        num_before_notice = handed.num_handed
        await asyncio.sleep(settings.drain_notice_ms / 1000)
        backlog_limit_s = settings.drain_grace_s - (time.monotonic() - began) - STOP_RESERVE_S
        await _serve_backlog(handed, handed.num_handed - num_before_notice, max(0.0, backlog_limit_s))
    try:
        async with asyncio.timeout(settings.drain_grace_s):  # not wait_for: it can swallow a cancellation on 3.11
            await service.drain(settings.drain_grace_s)
    except TimeoutError:
        log.warning("drain did not finish within %.1fs", settings.drain_grace_s)
    remaining_s = max(0.0, settings.drain_grace_s - (time.monotonic() - began))
    await server.stop(remaining_s)
    metrics_rotation.cancel()
    await service.close()
    provider.shutdown()
    log.info("stopped")


async def _serve_backlog(handed: RequestDecodingInterceptor, num_in_notice: int, limit_s: float) -> None:
    """Serves on until grpc core's queue of calls not yet handed to a handler is empty (the calls sent before
    health turned NOT_SERVING, which an event loop short of CPU may still be behind on), for at most `limit_s`:
    stopping the server cancels every queued call (services/common/call_backlog.py)."""
    served = await serve_backlog(lambda: handed.num_handed, limit_s)
    if not served.quiet:
        log.warning("calls still arriving %.1fs after the drain notice (%d during it, %d since); stopping anyway: "
                    "any still queued end CANCELLED", served.waited_s, num_in_notice, served.num_calls)
    else:
        log.info("no call queued any more %.1fs after the drain notice (%d calls handed over during it, %d since)",
                 served.waited_s, num_in_notice, served.num_calls)


def _add_port(server: grpc.aio.Server, settings: ServerSettings, tls_plan: tls.TlsPlan) -> int:
    address = f"{settings.host}:{settings.port}"
    if tls_plan.enabled:
        credentials, _watcher = tls.server_credentials(tls_plan)
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise ConfigError(f"cannot bind {address}")
    return port


_tls_gauges: dict[str, Gauge] = {}


def _report_tls(service_name: str, tls_plan: tls.TlsPlan) -> None:
    """One gauge (metrics.yaml) and, without TLS, one loud warning: plaintext must never go unnoticed."""
    name = f"infermesh_{service_name}_tls_enabled"
    if name not in _tls_gauges:
        _tls_gauges[name] = Gauge(name, "1 when the gRPC listener serves TLS, 0 when it serves plaintext")
    _tls_gauges[name].set(1 if tls_plan.enabled else 0)
    if not tls_plan.enabled:
        log.warning("TLS is OFF (--plaintext): the gRPC port accepts plaintext from anyone who can reach it, and "
                    "peers are not authenticated; set --tls-cert-file, --tls-key-file and --tls-ca-file instead "
                    "(docs/security.md)")
        return
    checks = "identity per method" if tls_plan.identity_policy else "no per-method identity check"
    log.info("TLS on (%s; %s)", "client certificates required" if tls_plan.require_client_cert
             else "no client certificates", checks)


def _start_metrics(settings: ServerSettings, tls_plan: tls.TlsPlan) -> RotatingMetricsCertificate | None:
    if settings.metrics_port < 0:
        return None
    https = tls_plan.enabled and settings.metrics_tls
    files = tls_plan.files if https else None
    metrics_server, _thread = start_http_server(
        settings.metrics_port, addr=settings.host,
        certfile=files.cert_path if files else None, keyfile=files.key_path if files else None,
    )
    scheme = "https" if https else "http"
    log.info("metrics on %s://%s:%d/metrics", scheme, settings.host, metrics_server.server_port)
    if files is None:
        return None
    # With files, start_http_server listens on an ssl.SSLSocket (its typeshed type is the plain socket).
    return RotatingMetricsCertificate(cast(ssl.SSLSocket, metrics_server.socket), files, time.monotonic)


async def _follow_rotation(certificate: RotatingMetricsCertificate | None) -> None:
    """Looks at the /metrics certificate files as often as the gRPC port's watcher does."""
    if certificate is None:
        return
    while True:
        await asyncio.sleep(DEFAULT_CHECK_INTERVAL_S)
        certificate.refresh()


def run(service_name: str, load: Callable[[], tuple[ServerSettings, Service]]) -> None:
    """Entry point for `python -m services.<name>`: config errors exit 2 with the reason."""
    try:
        settings, service = load()
        settings.require_listener_security(service_name)
    except ConfigError as exc:
        print(f"{service_name}: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(service_name, settings.log_level, settings.log_format)
    try:
        uvloop.run(serve(service_name, settings, service))
    except ConfigError as exc:
        # Certificate files are read at bind time, inside the loop: a bad one is still a configuration error.
        print(f"{service_name}: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
