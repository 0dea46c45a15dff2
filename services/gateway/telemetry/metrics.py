"""The gateway's Prometheus metrics, registered once per process on the default registry.

Names and labels are a contract with deploy/observability (dashboards, alerts);
change them only together. Label values:
  tenant    tenant id ("anonymous" in dev mode, "unauthenticated" before auth)
  model     model name as requested (a name the gateway does not know: "_other")
  version   the model version that served the request, or the last one an attempt was routed to
            (only versions the routing file or a scheduler reported, else "_other"; "_none" when
            no version was named or chosen: refused at admission, or a scheduler picked and failed)
  stage     a common.proto Stage name: queue_wait, batch_wait, preprocess, compute, network, ...
  service   the service that measured a stage: gateway | scheduler | worker
  file      tenants | routing | jwks (a reloaded config file); result applied | refused
  auth      how a caller was recognised: key | jwt | mtls | mtls+key | mtls+jwt | anonymous, or
            what a refused one presented (none: nothing); tenants/credentials.py AuthMethod
  method    Classify | Generate | ModelInfer
  code      final gRPC status name (OK, RESOURCE_EXHAUSTED, ...)
  priority  critical | standard | sheddable
  quota     requests_per_s | tokens_per_s | tokens_burst | max_in_flight
  upstream  scheduler host:port
  verdict   retry | failover | budget_exhausted | attempts_exhausted | deadline | pushback_stop | tokens_sent
  reason    limit | deadline | quota | shed | gateway_in_flight (why admission refused a request);
            unavailable | draining | cut | not_served (why a stream resumed)
  state     running | paused | rolled_back | promoted | aborted (a model's rollout, rollout/controller.py)
  action    start | advance | promote | roll_back | pause | resume | abort (a rollout decision)
  outcome   agreed | disagreed | failed | shed (a shadow call: its output compared, it failed, or
            it was not sent: over the shadow budget or shed as sheddable traffic)
  result    held | refused (a call held while no scheduler could take it, or refused as the hold was full)
  cause     scheduler_silent | held (why a call in flight was re-sent: its scheduler stopped answering, or
            it was held while none could take it)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from infermesh.v1 import common_pb2
from services.common.priority import Priority

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
NO_VERSION = "_none"

REQUESTS = Counter(
    "infermesh_gateway_requests",
    "Requests finished at the gateway, by final status code and the model version that served them.",
    ["tenant", "model", "version", "method", "code"],
)
REQUEST_DURATION = Histogram(
    "infermesh_gateway_request_duration_seconds",
    "Gateway-observed latency from receipt to the last byte (Generate: the whole stream), by model version.",
    ["model", "version", "method", "priority"],
    buckets=_LATENCY_BUCKETS_S,
)
STAGE_DURATION = Histogram(
    "infermesh_gateway_stage_duration_seconds",
    "Each stage of a served request as its response's timings report it (gateway, scheduler and worker "
    "stages), so a p99 splits into queue, batch wait, preprocess, compute and network.",
    ["model", "version", "service", "stage"],
    buckets=_LATENCY_BUCKETS_S,
)
CONFIG_RELOADS = Counter(
    "infermesh_gateway_config_reloads",
    "Changed config files re-read: applied, or refused (the previous config stays in force).",
    ["file", "result"],
)
QUOTA_REJECTIONS = Counter(
    "infermesh_gateway_quota_rejections",
    "Requests refused by a tenant quota.",
    ["tenant", "quota"],
)
SHED_REQUESTS = Counter(
    "infermesh_gateway_shed",
    "Requests shed under overload (RESOURCE_EXHAUSTED with a retry hint).",
    ["model", "priority"],
)
RETRIES = Counter(
    "infermesh_gateway_retries",
    "Retry decisions after a retryable failed attempt; verdict=retry are the retries made.",
    ["model", "upstream", "verdict"],
)
RETRY_BUDGET_REMAINING = Gauge(
    "infermesh_gateway_retry_budget_remaining",
    "Retries the upstream's budget still allows now; below 1 means exhausted.",
    ["upstream"],
)
FAILOVERS = Counter(
    "infermesh_gateway_failovers",
    "Calls re-sent to another scheduler because theirs was gone (outside the retry budget).",
    ["model"],
)
REDISPATCHES = Counter(
    "infermesh_gateway_redispatches",
    "Calls in flight re-sent after the gateway gave up on their scheduler (cause=scheduler_silent: it "
    "stopped answering); each is also in requests_total once, as the call it is.",
    ["model", "cause"],
)
HELD_CALLS = Counter(
    "infermesh_gateway_held_calls",
    "Calls that found no scheduler able to take them (every circuit open, every scheduler gone, restarting or "
    "silent) and were held to be re-sent when one can (result=held, once per call), or were refused because "
    "the hold was full (result=refused); each is also in requests_total once, as the call it is.",
    ["model", "result"],
)
HELD_REQUESTS = Gauge(
    "infermesh_gateway_held_requests",
    "Calls held now, waiting for a scheduler able to take them (at most --hold-max-calls).",
    ["model"],
)
RESPONSES_STORED = Gauge(
    "infermesh_gateway_responses_stored",
    "OpenAI Responses this gateway keeps now (--responses-store-bytes; docs/clients.md, \"Stored responses\").",
)
RESPONSES_STORED_BYTES = Gauge(
    "infermesh_gateway_responses_stored_bytes",
    "JSON bytes of the OpenAI Responses (with their contexts) and Conversations this gateway keeps now, in one "
    "bound (at most --responses-store-bytes).",
)
RESPONSES_DROPPED = Counter(
    "infermesh_gateway_responses_dropped",
    "Stored OpenAI Responses gone without a DELETE (reason=expired: their TTL; pushed_out: the least recently "
    "used, for a newer one), or never kept (reason=too_large: larger than the whole bound).",
    ["reason"],
)
CONVERSATIONS_STORED = Gauge(
    "infermesh_gateway_conversations_stored",
    "OpenAI Conversations this gateway keeps now, in the stored Responses' bound (docs/clients.md, \"Conversations\").",
)
CONVERSATIONS_DROPPED = Counter(
    "infermesh_gateway_conversations_dropped",
    "Stored OpenAI Conversations gone without a DELETE (reason=expired: their TTL from their last change; "
    "pushed_out: the least recently used, for a newer entry), or not kept (reason=too_large: larger than the whole "
    "bound, which refuses the change that made them so).",
    ["reason"],
)
STREAM_RESUMES = Counter(
    "infermesh_gateway_stream_resumes",
    "Generate streams resumed on another scheduler as a continuation after tokens were sent.",
    ["model", "reason"],
)
BREAKER_STATE = Gauge(
    "infermesh_gateway_breaker_state",
    "Circuit breaker per scheduler endpoint: 0 closed, 1 half-open, 2 open.",
    ["upstream"],
)
REFUSALS = Counter(
    "infermesh_gateway_refusals",
    "Requests refused by admission before any upstream call, by reason.",
    ["model", "reason", "priority"],
)
OBJECTIVE_STREAMS = Counter(
    "infermesh_gateway_objective_streams",
    "Generate streams served with a latency objective, by class and outcome (met, missed_ttft, missed_tpot, "
    "missed_both); the share meeting both is met / all.",
    ["model", "priority", "outcome"],
)
OBJECTIVE_TTFT = Gauge(
    "infermesh_gateway_objective_ttft_seconds",
    "Smoothed time to first token of served streams: predicted at admission (best scheduler, one-token prompt) "
    "and measured at the gateway (source = predicted | measured).",
    ["model", "priority", "source"],
)
OBJECTIVE_TTFT_ERROR = Histogram(
    "infermesh_gateway_objective_ttft_error_seconds",
    "Per served stream with an objective: |TTFT measured at the gateway - TTFT predicted at admission| (the "
    "predictor's error; its median against the class's target is the issue's criterion).",
    ["model", "priority"],
    buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0),
)
CONCURRENCY_LIMIT = Gauge(
    "infermesh_gateway_concurrency_limit",
    "The model's adaptive concurrency limit (critical traffic may fill all of it).",
    ["model"],
)
MODEL_IN_FLIGHT = Gauge(
    "infermesh_gateway_model_in_flight_requests",
    "Requests in flight upstream per model, counted against its adaptive limit.",
    ["model"],
)
IN_FLIGHT = Gauge("infermesh_gateway_in_flight_requests", "Requests in flight at the gateway.")
ANONYMOUS_ALLOWED = Gauge(
    "infermesh_gateway_anonymous_allowed",
    "1 when the gateway runs without a tenants file (--allow-anonymous: every caller admitted), else 0.",
)

ROLLOUT_STATE = Gauge(
    "infermesh_gateway_rollout_state",
    "1 for the current state of a model's rollout (running, paused, rolled_back, promoted, aborted), else 0.",
    ["model", "state"],
)
ROLLOUT_STEP = Gauge(
    "infermesh_gateway_rollout_step",
    "Index of the rollout's current step in its policy (0: the first, the shadow step when it has one).",
    ["model"],
)
ROLLOUT_CANARY_PERCENT = Gauge(
    "infermesh_gateway_rollout_canary_percent",
    "Share of the model's version-less requests the rollout sends to its canary version now, 0..100.",
    ["model", "version"],
)
ROLLOUT_DECISIONS = Counter(
    "infermesh_gateway_rollout_decisions",
    "Rollout decisions (each also logged with its evidence): start, advance, promote, roll_back, pause, "
    "resume, abort.",
    ["model", "action"],
)
SHADOW_REQUESTS = Counter(
    "infermesh_gateway_shadow_requests",
    "Mirrored (shadow) calls to a candidate version by outcome: agreed / disagreed with the primary's "
    "answer, failed, or shed (over the shadow budget, or shed as sheddable traffic).",
    ["model", "version", "outcome"],
)
GOLDEN_RUNS = Counter(
    "infermesh_gateway_rollout_golden_runs",
    "Runs of a rollout's golden cases against its canary version by outcome: passed (every case "
    "right), failed (a case answered wrongly: the step rolls back), incomplete (a case unanswered: tried again).",
    ["model", "version", "outcome"],
)
ROLLOUT_STATES = ("running", "paused", "rolled_back", "promoted", "aborted")

# Keyed by BreakerState's value (routing/circuit_breaker.py): metrics sit below every package that reports.
BREAKER_STATE_VALUE = {"closed": 0, "half_open": 1, "open": 2}


def observe_breakers(states: Mapping[str, enum.Enum]) -> None:
    for upstream, state in states.items():
        BREAKER_STATE.labels(upstream).set(BREAKER_STATE_VALUE[state.value])


def observe_budgets(balances: dict[str, float]) -> None:
    for upstream, balance in balances.items():
        RETRY_BUDGET_REMAINING.labels(upstream).set(balance)


def forget_upstream(upstream: str) -> None:
    """A scheduler endpoint left discovery for good: its series go, so the pod addresses that
    come and go with every rollout do not pile up in the metric store."""
    for metric in (RETRIES, RETRY_BUDGET_REMAINING, BREAKER_STATE):
        metric.remove_by_labels({"upstream": upstream})


class Refusal(enum.Enum):
    LIMIT = "limit"
    DEADLINE = "deadline"
    QUOTA = "quota"
    SHED = "shed"
    GATEWAY_IN_FLIGHT = "gateway_in_flight"
    # A Generate whose TTFT target no scheduler is predicted to meet (admission/latency_admission.py).
    OBJECTIVE = "objective"


_refusal_children: dict[tuple[str, Refusal, Priority], Any] = {}  # labelled prometheus children


def refused(model: str, priority: Priority, reason: Refusal) -> None:
    """refusals_total += 1; children are cached because this runs on the refusal path, which must stay cheap."""
    key = (model, reason, priority)
    child = _refusal_children.get(key)
    if child is None:
        if len(_refusal_children) > 10_000:  # model names come from clients: bound what a bad one can grow
            _refusal_children.clear()
        child = _refusal_children[key] = REFUSALS.labels(model, reason.value, priority.name.lower())
    child.inc()


_stage_children: dict[tuple[str, str, str, str], Any] = {}


def observe_stages(model: str, version: str, stages) -> None:
    """A served request's stage timings (common_pb2.StageTiming: stage number, duration_us, service).

    Labels are bounded: model and version come through metric_labels, stages and services are enums."""
    for timing in stages:
        key = (model, version, timing.service, timing.stage)
        child = _stage_children.get(key)
        if child is None:
            stage = _STAGE_NAMES.get(timing.stage)
            if stage is None or timing.service not in _SERVICES:
                continue
            child = _stage_children[key] = STAGE_DURATION.labels(model, version, timing.service, stage)
        child.observe(timing.duration_us / 1e6)


def stage_samples(stages) -> list[tuple[str, float]]:
    """A response's stage timings as ("<service>.<stage>", seconds) pairs (the rollout windows' names)."""
    samples = []
    for timing in stages:
        stage = _STAGE_NAMES.get(timing.stage)
        if stage is not None and timing.service in _SERVICES:
            samples.append((f"{timing.service}.{stage}", timing.duration_us / 1e6))
    return samples


_STAGE_NAMES = {value: name.removeprefix("STAGE_").lower() for name, value in common_pb2.Stage.items() if value}
_SERVICES = frozenset({"gateway", "scheduler", "worker"})


for _file in ("tenants", "routing", "jwks"):  # at 0 from the start, so rate() and alerts see the first refusal
    for _result in ("applied", "refused"):
        CONFIG_RELOADS.labels(_file, _result)


CALLERS = Counter(
    "infermesh_gateway_callers",
    "Callers at admission by tenant and how they were recognised (auth = key | jwt | mtls | mtls+key | mtls+jwt | "
    "anonymous), and refused ones (tenant 'unauthenticated', auth = what they presented, result refused): "
    "which services still send keys, and which identities fail.",
    ["tenant", "auth", "result"],
)


def caller_recognized(tenant_id: str, auth: str) -> None:
    CALLERS.labels(tenant_id, auth, "accepted").inc()


def caller_refused(presented: enum.Enum) -> None:
    """A caller refused at recognition (unknown key, bad token, unmatched certificate, conflicting identities)."""
    CALLERS.labels("unauthenticated", presented.value, "refused").inc()


def config_reload(file: str, applied: bool) -> None:
    CONFIG_RELOADS.labels(file, "applied" if applied else "refused").inc()


_in_flight_children: dict[str, Any] = {}


def observe_model_in_flight(model: str, num_in_flight: int) -> None:
    """Set on every change (a cached child's set() is a lock and a float): a sampled gauge misses bursts."""
    child = _in_flight_children.get(model)
    if child is None:
        child = _in_flight_children[model] = MODEL_IN_FLIGHT.labels(model)
    child.set(num_in_flight)


def observe_limits(limits: dict) -> None:
    """The adaptive limits (name -> AdaptiveLimit); the limit moves once per window, so it is sampled."""
    for model, limit in limits.items():
        CONCURRENCY_LIMIT.labels(model).set(int(limit.limit))


def observe_rollout(model: str, version: str, state: str, step_index: int, canary_percent: float) -> None:
    for name in ROLLOUT_STATES:
        ROLLOUT_STATE.labels(model, name).set(1 if name == state else 0)
    ROLLOUT_STEP.labels(model).set(step_index)
    ROLLOUT_CANARY_PERCENT.labels(model, version).set(canary_percent)


def rollout_decision(model: str, action: str) -> None:
    ROLLOUT_DECISIONS.labels(model, action).inc()


def golden_run(model: str, version: str, outcome: str) -> None:
    GOLDEN_RUNS.labels(model, version, outcome).inc()


def forget_rollout(model: str) -> None:
    """The routing file dropped the model's rollout policy: its gauges go (the counters stay)."""
    for metric in (ROLLOUT_STATE, ROLLOUT_STEP, ROLLOUT_CANARY_PERCENT):
        metric.remove_by_labels({"model": model})
