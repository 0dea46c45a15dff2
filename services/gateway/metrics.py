"""The gateway's Prometheus metrics, registered once per process on the default registry.

Names and labels are a contract with deploy/observability (dashboards, alerts);
change them only together. Label values:
  tenant    tenant id ("anonymous" in dev mode, "unauthenticated" before auth)
  model     model name as requested
  method    Classify | Generate | ModelInfer
  code      final gRPC status name (OK, RESOURCE_EXHAUSTED, ...)
  priority  critical | standard | sheddable
  quota     requests_per_s | tokens_per_s | tokens_burst | max_in_flight
  upstream  scheduler host:port
  verdict   retry | budget_exhausted | attempts_exhausted | deadline | pushback_stop | tokens_sent
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.gateway.circuit_breaker import BreakerState

REQUESTS = Counter(
    "infermesh_gateway_requests",
    "Requests finished at the gateway, by final status code.",
    ["tenant", "model", "method", "code"],
)
REQUEST_DURATION = Histogram(
    "infermesh_gateway_request_duration_seconds",
    "Gateway-observed latency from receipt to the last byte (Generate: the whole stream).",
    ["model", "method", "priority"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
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
BREAKER_STATE = Gauge(
    "infermesh_gateway_breaker_state",
    "Circuit breaker per scheduler endpoint: 0 closed, 1 half-open, 2 open.",
    ["upstream"],
)
IN_FLIGHT = Gauge("infermesh_gateway_in_flight_requests", "Requests in flight at the gateway.")

BREAKER_STATE_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


def observe_breakers(states: dict[str, BreakerState]) -> None:
    for upstream, state in states.items():
        BREAKER_STATE.labels(upstream).set(BREAKER_STATE_VALUE[state])


def observe_budgets(balances: dict[str, float]) -> None:
    for upstream, balance in balances.items():
        RETRY_BUDGET_REMAINING.labels(upstream).set(balance)
