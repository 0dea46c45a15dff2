"""Wiring: the public Inference service and KServe v2 on the gateway port, plus background loops.

Background: GetPressure/ListModels polling of every scheduler endpoint, the
tenants and routing file watchers (poll, and SIGHUP for an immediate reload of both).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from inference import grpc_predict_v2_pb2, grpc_predict_v2_pb2_grpc
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common import tls
from services.common.admin_servicer import SERVICE_NAME as ADMIN_SERVICE
from services.common.admin_servicer import AdminServicer, add_to_server
from services.common.cert_files import TlsFiles
from services.common.config import ConfigError
from services.common.file_watch import ReloadResult, WatchedFile
from services.common.metric_labels import KnownValues, KnownVersions
from services.common.priority import Priority
from services.common.server import Health
from services.gateway import admin_status
from services.gateway.admission.adaptive_limit import AdaptiveLimits
from services.gateway.admission.admission import (
    Admission,
    AdmissionParts,
    OpenTenants,
    RequestScope,
    WatchedTenants,
)
from services.gateway.admission.concurrency import ConcurrencyLimiter
from services.gateway.admission.shedding import LoadShedder
from services.gateway.admission.trace_trust import TraceTrust, TrustMode
from services.gateway.calls.classify_core import ClassifyCore
from services.gateway.calls.generate_core import GenerateCore
from services.gateway.calls.model_list import ModelList
from services.gateway.calls.text_calls import TextCalls
from services.gateway.config import GatewayConfig
from services.gateway.dispatch.deadlines import Deadlines
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.hold import CallHold
from services.gateway.dispatch.retry_budget import RetryBudgets
from services.gateway.dispatch.retry_policy import RetryPolicy
from services.gateway.fronts.kserve_servicer import KServeServicer
from services.gateway.fronts.servicer import InferenceServicer
from services.gateway.kserve.core import KServeCore
from services.gateway.quota.lease import SharedQuotas
from services.gateway.quota.quotas import TenantQuotas
from services.gateway.quota.store import ValkeyQuotaStore
from services.gateway.quota.sync import QuotaSync, default_gateway_id
from services.gateway.rollout.controller import RolloutController
from services.gateway.rollout.probe import RoutedGoldenProber
from services.gateway.rollout.shadow import ShadowMirror
from services.gateway.rollout.store import FileRolloutStore
from services.gateway.routing.catalog import ModelCatalog
from services.gateway.routing.circuit_breaker import CircuitBreakers
from services.gateway.routing.discovery import Resolver, SchedulerDiscovery
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.pressure_poller import PressurePoller
from services.gateway.routing.replicas import Membership, ReplicaSelector
from services.gateway.routing.silence_watch import SilenceWatch
from services.gateway.routing.table import (
    ModelRoute,
    RoutingConfigError,
    RoutingTable,
    VersionServing,
    describe_routes,
    load_routing_file,
)
from services.gateway.telemetry import metrics
from services.gateway.tenants.directory import TenantConfig, TenantConfigError, TenantConfigWatcher
from services.gateway.tenants.jwks import JwksReload
from services.gateway.upstream.clients import SchedulerClients, UpstreamMode

if TYPE_CHECKING:  # the HTTP fronts (and aiohttp) are imported only by a gateway given --http-port
    from services.gateway.fronts.http_server import HttpServer
    from services.gateway.fronts.openai_stored_http import StoredResponses

log = logging.getLogger(__name__)


def load_routing(config: GatewayConfig, breakers: CircuitBreakers, replicas: ReplicaSelector | None,
                 serving: VersionServing | None = None,
                 rollouts_of: Callable[[RoutingTable], RolloutController] | None = None,
                 ) -> tuple[RoutingTable, WatchedFile | None]:
    """The routing table, and the routing file's watcher that loads it now and on every change
    (into the table, then into the rollout controller `rollouts_of` makes for the table).

    A bad file at start raises ConfigError (the gateway does not start); later it is refused and
    logged, and the routing in force stays (services/common/file_watch.py)."""
    routing = RoutingTable((), breakers, replicas=replicas, serving=serving)
    if not config.routing_file:
        return routing, None
    rollouts = rollouts_of(routing) if rollouts_of is not None else None

    def apply(routes: tuple[ModelRoute, ...]) -> None:
        routing.replace(routes)
        if rollouts is not None:
            rollouts.apply_routes(routes)

    try:
        watched = WatchedFile(config.routing_file, load_routing_file, what="routing file", error=RoutingConfigError,
                              describe=describe_routes, on_reload=apply, log=log)
    except RoutingConfigError as exc:
        raise ConfigError(str(exc)) from None
    return routing, watched


class GatewayService:
    service_names = (
        gateway_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
        grpc_predict_v2_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
        ADMIN_SERVICE,
    )

    def __init__(self, config: GatewayConfig, clock=time.monotonic, resolver: Resolver | None = None) -> None:
        """Builds everything; a bad tenants or routing file raises ConfigError (the process exits 2).

        resolver: resolves a dns:/// scheduler address (the event loop's getaddrinfo by default)."""
        self._config = config
        self._health: Health | None = None
        self._tasks: list[asyncio.Task] = []
        self.http: HttpServer | None = None  # --http-port: made in register(), listening from start()
        self._http_closing: asyncio.Task | None = None
        self.breakers = CircuitBreakers(config.breaker_config(), clock)
        self.budgets = RetryBudgets(config.retry_budget_config(), clock)
        self.board = PressureBoard(clock, max_report_age_s=config.pressure_max_age_ms / 1000)
        self.discovery = SchedulerDiscovery(config.scheduler_target(), resolver,
                                            on_change=self._on_schedulers_changed)
        # Endpoints gone from discovery whose channels close once their calls' deadlines have passed.
        self._retiring: dict[str, asyncio.TimerHandle] = {}
        self.membership = Membership(lambda: self.discovery.endpoints)
        self.catalog = ModelCatalog()
        self.rollouts: RolloutController | None = None
        self.shadow: ShadowMirror | None = None
        self.routing, self.routing_file = load_routing(
            config, self.breakers, ReplicaSelector(self.membership, self.board), self.catalog.serving,
            rollouts_of=self._rollouts_of)
        self.clients = SchedulerClients(config.max_message_bytes, UpstreamMode(config.upstream_mode))
        self.quotas: TenantQuotas | SharedQuotas | None = None
        self.quota_sync: QuotaSync | None = None
        self.watcher: TenantConfigWatcher | None = None
        tenants: OpenTenants | WatchedTenants = OpenTenants()
        if config.tenants_file:
            self.quotas = self._build_quotas(config, clock)
            try:
                self.watcher = TenantConfigWatcher(config.tenants_file, on_reload=self._apply_tenants)
            except TenantConfigError as exc:
                raise ConfigError(str(exc)) from None
            tenants = WatchedTenants(self.watcher)
        deadlines = Deadlines(config.deadline_policy(), clock)
        self.hold = CallHold(config.hold_max_calls)
        self.limiter = ConcurrencyLimiter(config.max_in_flight)
        self.limits = AdaptiveLimits(config.limit_config(), clock)
        self.admission = Admission(
            AdmissionParts(
                limiter=self.limiter,
                tenants=tenants,
                routing=self.routing,
                deadlines=deadlines,
                board=self.board,
                shedder=LoadShedder(config.shedding_config(), self.board),
                limits=self.limits,
                quotas=self.quotas,
                model_label=KnownValues(self._knows_model),
                version_label=KnownVersions(self._knows_version, none=metrics.NO_VERSION),
                trace_trust=TraceTrust(TrustMode(config.trust_trace_context), tenants),
                on_finish=self._record_rollout if self.rollouts is not None else None,
                objectives=config.objective_policy(),
                ttft_admission=config.slo_admission,
                ttft_calibration=config.slo_calibration,
                ttft_admit_quantile=config.slo_admit_quantile,
            ),
            clock,
        )
        self.dispatcher = Dispatcher(
            routing=self.routing,
            clients=self.clients,
            policy=RetryPolicy(config.retry_policy_config()),
            budgets=self.budgets,
            breakers=self.breakers,
            deadlines=deadlines,
            board=self.board,
            max_resumes=config.stream_max_resumes,
            on_regroup=lambda: self.poller.poll_soon(),
            hold=self.hold,
        )
        self.poller = PressurePoller(
            routing=self.routing,
            clients=self.clients,
            board=self.board,
            catalog=self.catalog,
            breakers=self.breakers,
            interval_s=config.pressure_poll_interval_ms / 1000,
            membership=self.membership,
            after_poll=lambda: metrics.observe_budgets(self.budgets.balances()),
            on_answer=lambda endpoint, ready_models: self.hold.wake(ready_models),
            hold_on=self.hold.enabled,
        )

    def _rollouts_of(self, routing: RoutingTable) -> RolloutController:
        store = FileRolloutStore(self._config.rollout_state_file) if self._config.rollout_state_file else None
        self.rollouts = RolloutController(routing, store, decider=self._config.rollout_role == "decider")
        return self.rollouts

    def _record_rollout(self, scope: RequestScope, code: str, duration_s: float) -> None:
        """A version-less request of a model under rollout: a sample of the version the shares chose."""
        if scope.version or not scope.served_version or self.rollouts is None:
            return
        stages = metrics.stage_samples(scope.timings.stages) if scope.timings is not None else ()
        self.rollouts.record(scope.model, scope.served_version, code, duration_s, stages)

    def _knows_model(self, name: str) -> bool:
        """A model in the routing file, or one some scheduler reported (metric labels use only these)."""
        return self.routing.has_route(name) or self.catalog.knows(name)

    def _knows_version(self, model: str, version: str) -> bool:
        """A version of a known model in the routing file or reported by some scheduler."""
        return self.routing.has_version(model, version) or self.catalog.knows_version(model, version)

    def _on_schedulers_changed(self, added: tuple[str, ...], removed: tuple[str, ...]) -> None:
        for endpoint in added:
            retiring = self._retiring.pop(endpoint, None)
            if retiring is not None:
                retiring.cancel()
        for endpoint in removed:
            self.membership.forget(endpoint)
            self.board.forget(endpoint)
            self.catalog.forget(endpoint)
            # Calls already on it finish there, and none outlives the longest deadline: close its
            # channel then, so pod IPs that come and go with rollouts do not pile up channels.
            self._retiring[endpoint] = asyncio.get_running_loop().call_later(
                self._config.max_deadline_ms / 1000, self._retire, endpoint)

    def _retire(self, endpoint: str) -> None:
        self._retiring.pop(endpoint, None)
        self.breakers.forget(endpoint)
        self.budgets.forget(endpoint)
        metrics.forget_upstream(endpoint)
        self._tasks.append(asyncio.create_task(self.clients.retire(endpoint), name=f"retire {endpoint}"))

    def _build_quotas(self, config: GatewayConfig, clock) -> TenantQuotas | SharedQuotas:
        if not config.quota_store_address:
            return TenantQuotas(clock)
        quotas = SharedQuotas(clock, config.lease_config())
        store = ValkeyQuotaStore(
            config.quota_store_address, config.quota_store_prefix,
            gateway_id=config.gateway_id or default_gateway_id(),
            # Half the TTL: a slow sync is waited for (the next one starts later), a dead store is not.
            ttl_s=config.quota_store_ttl_ms / 1000, timeout_s=config.quota_store_ttl_ms / 2000,
        )
        self.quota_sync = QuotaSync(quotas, store)
        return quotas

    def _apply_tenants(self, config: TenantConfig) -> None:
        # Runs for the first load and every accepted reload; quota levels and in-flight counts carry over.
        if self.quotas is not None:  # built before the watcher that calls this
            self.quotas.update(config.tenants)

    def _shadow_mirror(self) -> ShadowMirror | None:
        if self.rollouts is None:
            return None
        parts, rollouts = self.admission.parts, self.rollouts

        def admits_sheddable(model: str) -> bool:
            utilization = parts.limiter.num_in_flight / parts.limiter.max_in_flight
            return parts.shedder.decide(model, Priority.SHEDDABLE, utilization).admit

        timeout_s = self._config.shadow_timeout_ms / 1000
        rollouts.prober = RoutedGoldenProber(self.routing, self.clients, admits_sheddable=admits_sheddable,
                                             timeout_s=timeout_s)
        return ShadowMirror(rollouts, self.routing, self.clients, admits_sheddable=admits_sheddable,
                            timeout_s=timeout_s, max_score_drift=rollouts.max_score_drift)

    def register(self, server) -> None:
        self.shadow = self._shadow_mirror()
        generate = GenerateCore(self.admission, self.dispatcher, shadow=self.shadow,
                                context_len=self.catalog.max_seq_len)
        classify = ClassifyCore(self.admission, self.dispatcher, shadow=self.shadow)
        models = ModelList(self.admission, self.clients)
        text = TextCalls(self.admission, self.clients, generators=lambda: [
            info.model.name for info in self.catalog.all_models() if info.kind == common_pb2.MODEL_KIND_GENERATOR])
        gateway_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(
            generate, classify, models, self.admission.parts.tenants.authenticate, text), server)
        kserve = KServeCore(admission=self.admission, catalog=self.catalog, refresh_catalog=self.poller.poll_once,
                            classify=classify.classify_admitted, generate=generate)
        grpc_predict_v2_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            KServeServicer(kserve, ready=self._ready), server)
        if self._config.http_port:
            self.http = self._http_server(generate, models, kserve, text)
        add_to_server(AdminServicer(*admin_status.handlers(self, self._config)), server)

    def _ready(self) -> bool:
        return bool(self._health and self._health.serving and self.poller.reachable)

    def _http_server(self, generate: GenerateCore, models: ModelList, kserve: KServeCore, text: TextCalls) -> HttpServer:
        from services.gateway.fronts.http_server import HttpServer
        from services.gateway.fronts.kserve_http import KServeHttp
        from services.gateway.fronts.openai_http import OpenAIFront

        config = self._config
        files = TlsFiles(config.tls_cert_file, config.tls_key_file, config.tls_ca_file) if config.tls_enabled else None
        return HttpServer(OpenAIFront(generate, models.list_models, self.admission.parts.tenants.authenticate,
                                      text=text, stored=self._stored_responses(),
                                      tokenizer_info=config.enable_tokenizer_info_endpoint),
                          config.host, config.http_port,
                          files, max_body_bytes=config.max_message_bytes, shutdown_timeout_s=config.drain_grace_s,
                          kserve=KServeHttp(kserve, ready=self._ready),
                          client_cert=tls.client_cert_mode(config, "gateway"), ready=self._ready,
                          cors_origins=config.http_cors_origins)

    def _stored_responses(self) -> StoredResponses | None:
        """The OpenAI front's stored Responses, kept per tenant; none when --responses-store-bytes is 0."""
        from services.gateway.fronts.openai_stored_http import StoredResponses
        from services.gateway.fronts.response_store import EntryKind, ResponseStore

        if not self._config.responses_store_bytes:
            return None
        tenants = self.admission.parts.tenants
        dropped = {EntryKind.RESPONSE: metrics.RESPONSES_DROPPED, EntryKind.CONVERSATION: metrics.CONVERSATIONS_DROPPED}
        store = ResponseStore(self._config.responses_store_bytes, self._config.responses_store_ttl_s,
                              on_dropped=lambda reason, kind: dropped[kind].labels(reason.value).inc())
        metrics.RESPONSES_STORED.set_function(lambda: store.num_responses)
        metrics.CONVERSATIONS_STORED.set_function(lambda: store.num_conversations)
        metrics.RESPONSES_STORED_BYTES.set_function(lambda: store.num_bytes)
        return StoredResponses(store, lambda authorization: tenants.authenticate(authorization).tenant_id)

    async def start(self, health: Health) -> None:
        self._health = health
        _report_anonymous(self._config)
        if tls.client_cert_mode(self._config, "gateway") == "optional":
            log.warning("--tls-client-auth optional: the HTTP port asks for client certificates; the gRPC port "
                        "does not (grpcio cannot ask without requiring), so gRPC callers there are recognised by "
                        "key or token; 'require' asks on both ports (docs/security.md)")
        if self.http is not None:
            await self.http.start()
        if self.discovery.target.is_dns:
            await self.discovery.refresh()  # the first answer before the first poll and the first call
            interval_s = self._config.discovery_interval_ms / 1000
            self._tasks.append(asyncio.create_task(self.discovery.run(interval_s), name="scheduler-discovery"))
        self._tasks.append(asyncio.create_task(self.poller.run(), name="pressure-poller"))
        if self._config.silence_probe_after_ms > 0:
            watch = SilenceWatch(self.clients, self.membership, silent_s=self._config.silence_probe_after_ms / 1000,
                                 probe_timeout_s=self._config.silence_probe_timeout_ms / 1000,
                                 hold_on=self.hold.enabled)
            self._tasks.append(asyncio.create_task(watch.run(), name="silence-watch"))
        if self.quota_sync is not None:
            await self.quota_sync.sync_once()  # leases (or the fallback share) before the first request
            self._tasks.append(asyncio.create_task(self.quota_sync.run(), name="quota-sync"))
        self._tasks.append(asyncio.create_task(self._observe_limits(), name="limit-gauges"))
        if self.rollouts is not None:
            for view in self.rollouts.views():  # logging is configured by now; the file was read before
                log.info("rollout %s canary %s: %s at step %s (%d/%d), canary share %g%%", view.model,
                         view.canary_version, view.state, view.step, view.step_index + 1, view.num_steps,
                         view.canary_percent)
            self._tasks.append(asyncio.create_task(self.rollouts.run(self._config.rollout_interval_ms / 1000),
                                                   name="rollouts"))
        if self._watched_files():
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            if self._config.tenants_poll_interval_ms > 0:
                self._tasks.append(asyncio.create_task(self._watch_files(), name="config-file-watcher"))
        await health.set_serving(True)

    def _watched_files(self) -> list[tuple[str, WatchedFile]]:
        files = [("routing", self.routing_file)] if self.routing_file is not None else []
        return files + ([("tenants", self.watcher.file)] if self.watcher is not None else [])

    def _on_sighup(self) -> None:
        for name, watched in self._watched_files():
            log.info("SIGHUP: reloading %s from %s", name, watched.path)
            _count_reload(name, watched.reload())
        self._poll_jwks()

    async def _watch_files(self) -> None:
        # The tenants and the routing file, and the tenants file's JWKS files, at the tenants file's interval.
        interval_s = self._config.tenants_poll_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            for name, watched in self._watched_files():
                _count_reload(name, watched.poll())
            self._poll_jwks()

    def _poll_jwks(self) -> None:
        if self.watcher is not None:
            _count_reload("jwks", self.watcher.poll_jwks())

    async def _observe_limits(self) -> None:
        while True:  # once a second, not per request: the admitted path stays cheap
            limits = self.limits.limits()
            for model, limit in limits.items():
                limit.num_slots = self.board.num_slots(model)
            metrics.observe_limits(limits)
            await asyncio.sleep(1.0)

    async def drain(self, grace_s: float) -> None:
        # The gRPC server's own graceful stop lets its in-flight calls finish; the HTTP listener closes
        # now and lets its requests finish meanwhile (within the same grace), awaited in close().
        if self.http is not None:
            self._http_closing = asyncio.create_task(self.http.close(), name="http-drain")

    async def close(self) -> None:
        for retiring in self._retiring.values():
            retiring.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.http is not None:
            await (self._http_closing or self.http.close())
        if self.quota_sync is not None:
            await self.quota_sync.close()
        if self.shadow is not None:
            await self.shadow.close()
        await self.clients.close()


def _report_anonymous(config: GatewayConfig) -> None:
    """The gauge, and a loud line: an open gateway must never go unnoticed (the config refuses one
    unless --allow-anonymous asked for it)."""
    anonymous = not config.tenants_file
    metrics.ANONYMOUS_ALLOWED.set(1 if anonymous else 0)
    if anonymous:
        log.warning("ANONYMOUS MODE (--allow-anonymous): no tenants file, every caller is admitted as tenant "
                    "'anonymous' with no quota; give --tenants-file outside development (docs/security.md)")


def _count_reload(name: str, result: ReloadResult | JwksReload | None) -> None:
    if result is not None:
        metrics.config_reload(name, result.applied)
