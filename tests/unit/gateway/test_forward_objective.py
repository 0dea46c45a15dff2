"""What the scheduler is told of a Generate's latency targets (generate_core.forward_objective)."""

from __future__ import annotations

from infermesh.v1 import gateway_pb2
from services.common.objectives import LatencyObjective
from services.gateway.calls.generate_core import forward_objective


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
