"""What gets in: the gateway's admission path, shared by the infermesh and KServe servicers.

In order, cheapest and most fundamental first, so a refused request costs little:

    concurrency limit -> auth -> model allowed -> routing (model known) -> deadline
    -> early reject (deadline below the model's minimum service time) -> predicted TTFT past the
    request's target everywhere (Generate) -> shedding -> quota
    -> the model's adaptive concurrency limit (by priority class)

`RequestScope` is one request's bookkeeping: the metric labels as they become
known, the concurrency permits and quota lease it holds (released exactly once
when the scope exits, with the Generate refund; the model's permit feeds the
adaptive limit the request's latency and outcome), and the final
`infermesh_gateway_requests_total` / duration observation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.common import log_context
from services.common.clock import Clock
from services.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InfermeshError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from services.common.metric_labels import OTHER
from services.common.objectives import LatencyObjective, ObjectiveOverride, ObjectivePolicy
from services.common.priority import Priority
from services.common.status import status_code_of
from services.common.telemetry import server_span
from services.gateway.admission.adaptive_limit import AdaptiveLimits, LimitPermit, Outcome
from services.gateway.admission.concurrency import ConcurrencyLimiter, ConcurrencyPermit
from services.gateway.admission.latency_admission import StarvedGateway, WaitedPastObjective, check_ttft
from services.gateway.admission.objective_outcome import TtftMeans, judge, measure
from services.gateway.admission.shedding import LoadShedder
from services.gateway.admission.trace_trust import TraceTrust
from services.gateway.admission.ttft_calibration import TtftCalibration
from services.gateway.dispatch.deadlines import Deadline, Deadlines
from services.gateway.quota.quotas import Lease, QuotaExceeded, Quotas
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.table import RoutingTable
from services.gateway.telemetry import metrics
from services.gateway.telemetry.tracing import span
from services.gateway.tenants.credentials import AuthMethod, Authorization, presented
from services.gateway.tenants.directory import (
    ALL_MODELS,
    Recognition,
    Tenant,
    TenantConfigWatcher,
    TenantQuota,
)

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("infermesh.gateway")
# Server spans are named by the full RPC method (OpenTelemetry RPC conventions).
_INFERENCE_SERVICE = "infermesh.v1.Inference"
_KSERVE_SERVICE = "inference.GRPCInferenceService"


# Development mode (no tenants file): every caller is this tenant, with no quotas.
ANONYMOUS = Tenant(
    tenant_id="anonymous",
    priority=Priority.STANDARD,
    weight=1,
    allowed_models=frozenset({ALL_MODELS}),
    quota=TenantQuota(requests_per_s=1e9, requests_burst=10**9, tokens_per_s=1e9, tokens_burst=10**9,
                      max_in_flight=10**9),
    api_key_sha256=(),
)
UNAUTHENTICATED = "unauthenticated"  # tenant label of requests refused before auth


class TenantSource(Protocol):
    def authenticate(self, authorization: Authorization) -> Tenant: ...

    def recognize(self, authorization: Authorization) -> Recognition: ...

    def check_model_allowed(self, tenant: Tenant, model_name: str) -> None: ...


class OpenTenants:
    """Development mode: everyone is ANONYMOUS and may use every model."""

    def authenticate(self, authorization: Authorization) -> Tenant:
        return ANONYMOUS

    def recognize(self, authorization: Authorization) -> Recognition:
        return Recognition(ANONYMOUS, AuthMethod.ANONYMOUS)

    def check_model_allowed(self, tenant: Tenant, model_name: str) -> None:
        return None


class WatchedTenants:
    """The tenants file in force, as the watcher last loaded it (reloads swap it atomically)."""

    def __init__(self, watcher: TenantConfigWatcher) -> None:
        self.watcher = watcher

    def authenticate(self, authorization: Authorization) -> Tenant:
        return self.watcher.directory.authenticate(authorization)

    def recognize(self, authorization: Authorization) -> Recognition:
        return self.watcher.directory.recognize(authorization)

    def check_model_allowed(self, tenant: Tenant, model_name: str) -> None:
        self.watcher.directory.check_model_allowed(tenant, model_name)


class RequestScope:
    """One request's life at the gateway; use as a context manager around the whole handler.

    Entering it opens the request's server span (`gateway.<method>`, child of the caller's
    trace context) and makes it current; leaving it tags the span with the final status code.
    """

    def __init__(
        self, method: str, model: str, version: str, clock: Clock, limiter: ConcurrencyLimiter,
        parent: otel_context.Context | None = None, metric_model: str | None = None,
        version_label: Callable[[str, str], str] | None = None, links: tuple[trace.Link, ...] = (),
        on_finish: Callable[[RequestScope, str, float], None] | None = None,
    ) -> None:
        self.method = method
        self.model = model
        # The model as metrics label it: the name when the gateway knows the model (routing file, or a
        # scheduler reported it), else "_other", so made-up names cannot grow the metric store.
        self.metric_model = model if metric_model is None else metric_model
        self.version = version
        # The version that served the request, or the last one an attempt was routed to (served_by).
        self.served_version = version
        self._version_label = version_label or _unlabelled_version
        # A served request's timings (common_pb2.Timings: this module keeps protobuf out), for the
        # per-stage histogram.
        self.timings: Any = None
        self.began_s = clock()
        self._clock = clock
        self._limiter = limiter
        self.tenant_id = UNAUTHENTICATED
        self.tenant: Tenant | None = None  # set by admission; admitted_tenant after it
        self.deadline: Deadline | None = None
        # Generate: the TTFT / TPOT targets admission resolved (common/objectives.py); None for Classify.
        self.objective: LatencyObjective | None = None
        # The best scheduler's predicted TTFT for its class and prompt at admission, seconds; None: none predicted.
        self.predicted_ttft_s: float | None = None
        # What admission multiplied its class's predicted TTFT by to judge it (ttft_calibration.py: the admission
        # quantile's factor); routing judges the replicas' own predictions with it.
        self.ttft_correction = 1.0
        # What its own prompt's prefill adds to the predicted TTFT, seconds (the board predicts a one-token prompt).
        self.own_prefill_s = 0.0
        # Generate: when its first and latest tokens were sent (scope clock), and how many (tokens_sent).
        self.first_token_s: float | None = None
        # An admitted Generate's TTFT goes here (seconds from began_s; True: it ended without a first token, so
        # the time it waited is a lower bound): the admission predictor's correction (ttft_calibration.py).
        self.on_ttft: Callable[[float, bool], None] | None = None
        self.last_token_s = 0.0
        self.num_tokens_sent = 0
        self.permit: ConcurrencyPermit | None = None
        # The model's adaptive-limit slot; streams call first_response() on their first chunk.
        self.model_permit: LimitPermit | None = None
        self.lease: Lease | None = None
        # Generate: tokens the request really used (prompt + generated), for the quota refund.
        self.num_tokens_used: int | None = None
        self._parent = parent
        self._links = links
        # (scope, final code, seconds from receipt): the rollout controller's per-version samples.
        self._on_finish = on_finish

    @property
    def admitted_tenant(self) -> Tenant:
        """The tenant admission established; read only after admit() succeeded."""
        if self.tenant is None:
            raise RuntimeError("the request's tenant was read before admission")
        return self.tenant

    def served_by(self, version: str) -> None:
        """An attempt was routed to `version`, or a reply said it served; "" (the scheduler picks) is no news."""
        if version:
            self.served_version = version

    @property
    def metric_version(self) -> str:
        """The requested version as metrics label it: OTHER for one no routing file or scheduler ever named."""
        return self._version_label(self.metric_model, self.version)

    def tokens_sent(self, num_tokens: int) -> None:
        """A chunk with `num_tokens` went to the client now (the stream's TTFT and TPOT)."""
        if num_tokens <= 0:
            return
        now_s = self._clock()
        if self.first_token_s is None:
            self.first_token_s = now_s
            self._report_ttft(now_s - self.began_s, censored=False)
        self.last_token_s = now_s
        self.num_tokens_sent += num_tokens

    @property
    def priority(self) -> Priority:
        return self.tenant.priority if self.tenant is not None else Priority.STANDARD

    def __enter__(self) -> RequestScope:
        service = _KSERVE_SERVICE if self.method.startswith("Model") else _INFERENCE_SERVICE
        self._server_span = server_span(_tracer, f"{service}/{self.method}", self._parent, self._links)
        self.span = self._server_span.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        code = _code_name(exc)
        self.span.set_attribute("infermesh.tenant", self.tenant_id)
        if log.isEnabledFor(logging.DEBUG):  # with its ids, like every line about the request
            log.debug("%s %r finished: %s in %.1f ms", self.method, self.model, code,
                      (self._clock() - self.began_s) * 1000)
        self._server_span.__exit__(exc_type, exc, tb)  # rpc.grpc.status_code, ERROR status
        self.finish(code)

    def _report_ttft(self, waited_s: float, *, censored: bool) -> None:
        """To the admission predictor's correction: the TTFT (or, `censored`, the wait without a first token)
        less the time no scheduler could take the request (held through an outage, failing over): an outage
        is no news of how fast the schedulers start a stream, and taught as such it raised every class's
        prediction up to 4x for seconds after the schedulers were back (test_all_schedulers_unavailable)."""
        if self.on_ttft is None:
            return
        unserved_s = 0.0 if self.model_permit is None else self.model_permit.unserved_s()
        if unserved_s is not None:  # None: it waits for a scheduler now
            self.on_ttft(max(0.0, waited_s - unserved_s), censored)

    def finish(self, code: str) -> None:
        if self.first_token_s is None:
            self._report_ttft(self._clock() - self.began_s, censored=True)
        self.on_ttft = None
        if self.model_permit is not None:
            self.model_permit.done(_LIMIT_OUTCOMES.get(code, Outcome.IGNORED))
            metrics.observe_model_in_flight(self.metric_model, self.model_permit.num_in_flight)
            self.model_permit = None
        if self.lease is not None:
            self.lease.release(self.num_tokens_used)
            self.lease = None
        if self.permit is not None:
            self.permit.release()
            self.permit = None
            metrics.IN_FLIGHT.set(self._limiter.num_in_flight)
        version = self._version_label(self.metric_model, self.served_version)
        duration_s = self._clock() - self.began_s
        metrics.REQUESTS.labels(self.tenant_id, self.metric_model, version, self.method, code).inc()
        metrics.REQUEST_DURATION.labels(self.metric_model, version, self.method, self.priority.name.lower()).observe(
            duration_s
        )
        if self._on_finish is not None:
            self._on_finish(self, code, duration_s)
        if self.timings is not None:
            metrics.observe_stages(self.metric_model, version, self.timings.stages)
        if code == "OK" and self.objective is not None and self.first_token_s is not None:
            self._observe_objective(self.objective, self.first_token_s)

    def _observe_objective(self, objective: LatencyObjective, first_token_s: float) -> None:
        latency = measure(self.began_s, first_token_s, self.last_token_s, self.num_tokens_sent)
        priority = self.priority.name.lower()
        metrics.OBJECTIVE_STREAMS.labels(self.metric_model, priority, judge(objective, latency).value).inc()
        if self.predicted_ttft_s is None:
            return  # both means over the same streams, or the gap between the gauges is no error
        metrics.OBJECTIVE_TTFT_ERROR.labels(self.metric_model, priority).observe(
            abs(latency.ttft_s - self.predicted_ttft_s))
        for source, seconds in (("predicted", self.predicted_ttft_s), ("measured", latency.ttft_s)):
            mean_s = _TTFT_MEANS.add(self.metric_model, priority, source, seconds)
            metrics.OBJECTIVE_TTFT.labels(self.metric_model, priority, source).set(mean_s)


# Smoothed predicted and measured TTFT behind infermesh_gateway_objective_ttft_seconds.
_TTFT_MEANS = TtftMeans()


# How a request's final status reads as a load signal for its model's adaptive limit. Upstream refusals
# as too late or too much are congestion; bad input, cancellation and a missing worker are not.
_LIMIT_OUTCOMES = {
    "OK": Outcome.SUCCESS,
    "DEADLINE_EXCEEDED": Outcome.DROPPED,
    "RESOURCE_EXHAUSTED": Outcome.DROPPED,
}


def _unlabelled_version(model: str, version: str) -> str:
    return metrics.NO_VERSION if not version else OTHER


def _code_name(exc: BaseException | None) -> str:
    if exc is None:
        return "OK"
    if isinstance(exc, InfermeshError):
        return status_code_of(exc).name
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"
    return "INTERNAL"


@dataclass(frozen=True)
class AdmissionParts:
    limiter: ConcurrencyLimiter
    tenants: TenantSource
    routing: RoutingTable
    deadlines: Deadlines
    board: PressureBoard
    shedder: LoadShedder
    limits: AdaptiveLimits
    # None in development mode (no tenants file): no quotas.
    quotas: Quotas | None
    # A requested model's metric label and adaptive-limit key (services/common/metric_labels.py).
    model_label: Callable[[str], str]
    # (model label, version) -> the version's metric label (metric_labels.KnownVersions).
    version_label: Callable[[str, str], str] = _unlabelled_version
    # Whose trace context a request's span follows (trace_trust.py); by default nobody's.
    trace_trust: TraceTrust = TraceTrust()
    # Every finished request's (scope, code, duration_s): the rollout controller's samples.
    on_finish: Callable[[RequestScope, str, float], None] | None = None
    # Per-class latency objectives and their bounds; None: requests carry none.
    objectives: ObjectivePolicy | None = None
    # Refuse a Generate predicted to miss its TTFT target at every scheduler (latency_admission.py);
    # False: deadlines alone, as before objectives existed.
    ttft_admission: bool = True
    # Correct the predicted TTFT by what the streams served measured against it (ttft_calibration.py).
    ttft_calibration: bool = True
    # With the correction: the quantile of the predicted TTFT that must meet the target (0.5: the median).
    ttft_admit_quantile: float = 0.95


class Admission:
    def __init__(self, parts: AdmissionParts, clock: Clock) -> None:
        self.parts = parts
        self.clock = clock
        # Lower classes shed while a higher one waits past its TTFT target before the handler runs.
        self.starved = StarvedGateway()
        # Each class's measured / predicted TTFT, learned from the streams admitted here.
        self.calibration = TtftCalibration()

    def scope(self, method: str, model: str, version: str = "", metadata=None,
              authorization: Authorization = None) -> RequestScope:
        """The request's scope; its span's parent comes from the call's metadata if the caller is trusted."""
        parent, links = self.parts.trace_trust.parent(metadata, authorization)
        return RequestScope(method, model, version, self.clock, self.parts.limiter, parent,
                            metric_model=self.parts.model_label(model), version_label=self.parts.version_label,
                            links=links, on_finish=self.parts.on_finish)

    def _learn_ttft(self, scope: RequestScope, predicted_s: float, priority: Priority,
                    objective: LatencyObjective) -> Callable[[float, bool], None]:
        """What an admitted stream reports its TTFT to: the correction of its class (ttft_calibration.py), against
        `predicted_s`, the board's prediction before the correction."""
        model, calibration, target_s = scope.model, self.calibration, objective.ttft_ms / 1000

        def learn(measured_s: float, censored: bool) -> None:
            calibration.observe(model, priority, predicted_s=predicted_s, measured_s=measured_s, target_s=target_s,
                                now_s=self.clock(), censored=censored)
        return learn

    def admit(
        self, scope: RequestScope, authorization: Authorization, client_timeout_s: float | None, num_tokens: int = 0,
        priority: Priority | None = None, check_request: Callable[[], None] | None = None,
        objective: Callable[[], ObjectiveOverride] | None = None, waited_s: float = 0.0,
        num_prompt_tokens: int = 0, judge_ttft: bool = True,
    ) -> None:
        """Admit the request or raise the domain error that refuses it; fills `scope`.

        priority: the class the request asks for; it lowers its tenant's for this request, never raises it.
        check_request: the request's own checks (raising InvalidArgument), run once the caller is
        authenticated: a caller without a valid key learns nothing about its request, and a bad
        request is counted under its tenant.
        objective: the request's own latency targets (Generate), read at the same point; with the
        tenant's and its class's they resolve to `scope.objective` (InvalidArgument out of bounds).
        waited_s: what the request spent before the handler ran (its ingress), counted against its TTFT target.
        num_prompt_tokens: a Generate's prompt length as the gateway estimates it (an upper bound): its own prefill
        is added to the schedulers' one-token prediction, both where admission judges it and where its measured
        TTFT teaches the prediction's correction.
        judge_ttft: False for a further choice of a request whose first choice was judged and has started
        (generate_core.py): its objective is resolved (TPOT paces it) but its TTFT is neither predicted, judged nor
        taught to the correction (it starts behind its siblings, a burst the request itself sent)."""
        parts = self.parts
        try:
            scope.permit = parts.limiter.acquire()
        except Unavailable:
            metrics.refused(scope.metric_model, Priority.STANDARD, metrics.Refusal.GATEWAY_IN_FLIGHT)
            raise
        metrics.IN_FLIGHT.set(parts.limiter.num_in_flight)
        with span("auth"):
            try:
                recognition = parts.tenants.recognize(authorization)
            except (Unauthenticated, PermissionDenied):
                metrics.caller_refused(presented(authorization))
                raise
            tenant, auth = recognition.tenant, recognition.method.value
            metrics.caller_recognized(tenant.tenant_id, auth)
            if priority is not None and priority > tenant.priority:  # a larger value is a lower class
                tenant = replace(tenant, priority=priority)
            scope.tenant, scope.tenant_id = tenant, tenant.tenant_id
            log_context.bind(tenant=tenant.tenant_id, auth=auth)
            if check_request is not None:
                check_request()
            if objective is not None and parts.objectives is not None:
                scope.objective = parts.objectives.resolve(tenant.priority, tenant.objectives, objective())
            parts.tenants.check_model_allowed(tenant, scope.model)
        with span("routing"):
            parts.routing.model(scope.model)
        try:
            scope.deadline = parts.deadlines.start(client_timeout_s)
            parts.deadlines.check_can_finish(scope.deadline, scope.model, parts.board.min_service_time_s(scope.model))
        except DeadlineExceeded:
            metrics.refused(scope.metric_model, tenant.priority, metrics.Refusal.DEADLINE)
            raise
        board_ttft_s: float | None = None  # the schedulers' predicted TTFT for its class, before the correction
        judged_ttft_s: float | None = None  # the quantile of it admission judges (ttft_calibration.py)
        one_token_s: float | None = None  # the schedulers' prediction for a one-token prompt, as reported
        if scope.objective is not None and judge_ttft:
            report = parts.board.pressure(scope.model)
            board_ttft_s = one_token_s = parts.board.predicted_ttft_s(report, tenant.priority)
            if board_ttft_s is not None and report is not None:
                # The board predicts a one-token prompt; this stream's own prefill comes on top. The prompt's length
                # is the quota's upper bound, and the correction learns against the same figure, so a class's
                # typical over-estimate is corrected away; only an unusually long prompt reads long.
                scope.own_prefill_s = max(0, num_prompt_tokens - 1) * report.ttft_per_prompt_token_s
                board_ttft_s += scope.own_prefill_s
            judged_ttft_s = scope.predicted_ttft_s = board_ttft_s
            if board_ttft_s is not None and parts.ttft_calibration:
                calibration, model, priority, now_s = self.calibration, scope.model, tenant.priority, scope.began_s
                median, scope.ttft_correction = calibration.factors(model, priority, now_s, parts.ttft_admit_quantile)
                scope.predicted_ttft_s = board_ttft_s * median
                judged_ttft_s = board_ttft_s * scope.ttft_correction
        if scope.objective is not None and parts.ttft_admission and judge_ttft:
            target_s = scope.objective.ttft_ms / 1000
            if (judged_ttft_s is not None and one_token_s is not None and judged_ttft_s + waited_s > target_s
                    and parts.board.nothing_waiting(scope.model, tenant.priority, target_s)):
                # Nothing waits on some scheduler: the stream starts there on the next steps, and only its own
                # prefill (estimated from bytes) or a correction learned from cold starts would read it past its
                # target; that is no overload, and a retry would fare no better. Only its wait before the
                # handler still counts.
                judged_ttft_s = one_token_s
            try:
                self.starved.check(scope.model, tenant.priority, scope.began_s)
                check_ttft(scope.model, tenant.priority, scope.objective, report, waited_s=waited_s,
                           predicted_s=judged_ttft_s, median_s=scope.predicted_ttft_s)
            except (FailedPrecondition, ResourceExhausted) as exc:
                if isinstance(exc, WaitedPastObjective):
                    self.starved.refused(scope.model, tenant.priority, waited_s, scope.began_s)
                metrics.refused(scope.metric_model, tenant.priority, metrics.Refusal.OBJECTIVE)
                raise
        # Utilization as it was before this request arrived: the request at 90% is the one refused.
        utilization = (parts.limiter.num_in_flight - 1) / parts.limiter.max_in_flight
        try:
            parts.shedder.check(scope.model, tenant.priority, utilization)
        except ResourceExhausted:
            metrics.SHED_REQUESTS.labels(scope.metric_model, tenant.priority.name.lower()).inc()
            metrics.refused(scope.metric_model, tenant.priority, metrics.Refusal.SHED)
            raise
        if parts.quotas is not None:
            with span("quota"):
                try:
                    scope.lease = parts.quotas.admit(tenant, num_tokens)
                except QuotaExceeded as exc:
                    metrics.QUOTA_REJECTIONS.labels(tenant.tenant_id, exc.kind).inc()
                    metrics.refused(scope.metric_model, tenant.priority, metrics.Refusal.QUOTA)
                    raise
        # Last: a permit taken here is held only by requests that go upstream, and a request refused
        # by its own tenant's quota never takes a slot another tenant could use.
        limit = parts.limits.for_model(scope.metric_model)  # one limiter per known model, one for the rest
        try:
            scope.model_permit = limit.acquire(tenant.priority, scope.deadline.remaining_s(self.clock()),
                                               tenant_id=tenant.tenant_id, weight=tenant.weight)
        except ResourceExhausted:
            metrics.refused(scope.metric_model, tenant.priority, metrics.Refusal.LIMIT)
            raise
        metrics.observe_model_in_flight(scope.metric_model, limit.num_in_flight)
        if scope.objective is not None and board_ttft_s is not None and parts.ttft_calibration:
            # Against the prediction for its own prompt: a long prompt's prefill is no error of the wait's prediction.
            scope.on_ttft = self._learn_ttft(scope, board_ttft_s, tenant.priority, scope.objective)
