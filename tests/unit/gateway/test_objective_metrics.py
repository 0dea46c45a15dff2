"""The predictor's error made visible: a served stream with an objective sets the predicted and measured
TTFT gauges and the error histogram (admission/admission.py RequestScope, admission/objective_outcome.py)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from services.common.objectives import LatencyObjective
from services.common.priority import Priority
from services.gateway.admission.admission import RequestScope
from services.gateway.admission.concurrency import ConcurrencyLimiter
from services.gateway.tenants.directory import Tenant

from .conftest import make_tenant

OBJECTIVE = LatencyObjective(ttft_ms=200, tpot_ms=50)


def _gauge(model: str, source: str) -> float | None:
    return REGISTRY.get_sample_value("infermesh_gateway_objective_ttft_seconds",
                                     {"model": model, "priority": "critical", "source": source})


def _errors(model: str) -> tuple[float, float]:
    labels = {"model": model, "priority": "critical"}
    return (REGISTRY.get_sample_value("infermesh_gateway_objective_ttft_error_seconds_count", labels) or 0.0,
            REGISTRY.get_sample_value("infermesh_gateway_objective_ttft_error_seconds_sum", labels) or 0.0)


def _serve(clock, model: str, predicted_ttft_s: float | None, ttft_s: float, tenant: Tenant) -> None:
    scope = RequestScope("Generate", model, "", clock, ConcurrencyLimiter(4))
    scope.tenant = tenant
    scope.objective = OBJECTIVE
    scope.predicted_ttft_s = predicted_ttft_s
    clock.advance(ttft_s)
    scope.tokens_sent(1)
    clock.advance(0.04)
    scope.tokens_sent(1)
    scope.finish("OK")


@pytest.fixture
def critical() -> Tenant:
    return make_tenant(priority=Priority.CRITICAL)


def test_a_served_stream_sets_predicted_and_measured_ttft_and_their_error(clock, critical):
    _serve(clock, "gauge-model-a", 0.1, 0.3, critical)
    assert _gauge("gauge-model-a", "predicted") == pytest.approx(0.1)
    assert _gauge("gauge-model-a", "measured") == pytest.approx(0.3)
    assert _errors("gauge-model-a") == (1, pytest.approx(0.2))


def test_a_stream_admitted_without_a_prediction_moves_neither_gauge(clock, critical):
    _serve(clock, "gauge-model-b", 0.1, 0.1, critical)
    _serve(clock, "gauge-model-b", None, 5.0, critical)  # no fresh report at admission
    assert _gauge("gauge-model-b", "predicted") == pytest.approx(0.1)
    assert _gauge("gauge-model-b", "measured") == pytest.approx(0.1), "the two means cover the same streams"
    assert _errors("gauge-model-b")[0] == 1
