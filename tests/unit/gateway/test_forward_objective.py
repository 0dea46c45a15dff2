"""What the scheduler is told of a Generate's latency targets (generate_core.forward_objective)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from infermesh.v1 import gateway_pb2
from services.common.objectives import LatencyObjective
from services.common.priority import Priority
from services.gateway.calls.generate_core import forward_objective, schedule_request


def _sent(ttft_ms: int = 0, tpot_ms: int = 0) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="hi", objectives=gateway_pb2.LatencyObjectives(ttft_ms=ttft_ms,
                                                                                               tpot_ms=tpot_ms))


def test_the_resolved_targets_travel_on_in_whole_milliseconds():
    request = _sent(ttft_ms=5000)
    forward_objective(request, LatencyObjective(ttft_ms=200.4, tpot_ms=0.2), judged=True)
    assert (request.objectives.ttft_ms, request.objectives.tpot_ms) == (200, 1)


def test_with_admission_on_predicted_latency_off_the_scheduler_gets_no_target_not_even_the_clients():
    request = _sent(ttft_ms=200, tpot_ms=50)
    forward_objective(request, LatencyObjective(ttft_ms=200.0, tpot_ms=50.0), judged=False)
    assert not request.HasField("objectives")
    unresolved = _sent(ttft_ms=200)
    forward_objective(unresolved, None, judged=True)
    assert not unresolved.HasField("objectives")


def _scope(objective: LatencyObjective | None, correction: float) -> SimpleNamespace:
    return SimpleNamespace(admitted_tenant=SimpleNamespace(tenant_id="t", priority=Priority.CRITICAL, weight=1), objective=objective,
                           ttft_correction=correction)


def test_the_scheduler_judges_its_prediction_by_the_factor_admission_judged_it_by():
    objective = LatencyObjective(ttft_ms=200.0, tpot_ms=50.0)
    upstream = schedule_request(_sent(), _scope(objective, 0.6), judged=True)  # type: ignore[arg-type]
    assert upstream.ttft_prediction_factor == pytest.approx(0.6)
    assert upstream.tenant.tenant_id == "t" and upstream.request.prompt == "hi"
    for scope, judged in ((_scope(objective, 0.6), False), (_scope(None, 0.6), True)):
        assert schedule_request(_sent(), scope, judged).ttft_prediction_factor == 0  # type: ignore[arg-type]
