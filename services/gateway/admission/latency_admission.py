"""Admission on predicted latency: refuse a stream that cannot meet its TTFT target anywhere.

The schedulers predict, per priority class, the time to first token of a new one-token prompt on
their best worker (scheduler/latency_predictor.py), and the least TTFT any request could have there
(one step computing one token alone); the pressure board keeps the best of them over every
scheduler serving the model. A request is refused, before it holds any quota or slot:

- FAILED_PRECONDITION when its TTFT target is below that least TTFT, or its TPOT target below it (one
  step alone is also the fastest a token can follow another): no scheduler could ever meet it, so
  waiting would not help (the message names both times);
- RESOURCE_EXHAUSTED with a retry hint when even the best scheduler's prediction for its class is
  past its target: it would miss its target wherever it went. A class sees the prompt tokens
  queued at or above itself, so sheddable streams are refused first.

A request that says when it was sent (`x-request-start`) has its wait before the gateway's handler
counted too: on a starved gateway requests queue before the handler runs, and the client's TTFT
includes that wait (bench_slo, tinylm at 4x: ~130 ms between the client's TTFT and the gateway's).

The prediction is a lower bound on the request's own TTFT (a one-token prompt), so a request
refused here would have missed; one admitted may still miss, and is counted so. No fresh report
(a scheduler that predicts nothing, or none heard from): admitted, as shedding fails open.

Pure: no gRPC, no clock.
"""

from __future__ import annotations

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.common.objectives import LatencyObjective
from services.common.priority import Priority
from services.gateway.routing.pressure import PressureReport


class ObjectiveUnmeetable(FailedPrecondition):
    """The TTFT or TPOT target is below one step alone: no scheduler could ever meet it (HTTP 400)."""


class TpotUnmeetable(ObjectiveUnmeetable):
    """The TPOT target is below one step alone (its own HTTP error code: tpot_objective_unmeetable)."""


class ObjectiveMissed(ResourceExhausted):
    """Every scheduler is predicted to miss the TTFT target now (HTTP 429, with Retry-After)."""


# A refused request is told to come back no sooner than this (the next pressure poll may differ).
MIN_RETRY_AFTER_S = 0.05


def check_ttft(model: str, priority: Priority, objective: LatencyObjective, report: PressureReport | None, *,
               waited_s: float = 0.0) -> None:
    """Raises FailedPrecondition (never meetable) or ResourceExhausted (predicted miss everywhere).
    `waited_s`: what the request already spent before the gateway's handler ran (its ingress, from the
    client's `x-request-start`): its first token reaches the client that much later than predicted."""
    if report is None:
        return
    target_s = objective.ttft_ms / 1000
    if report.min_ttft_s > 0 and target_s < report.min_ttft_s:
        raise ObjectiveUnmeetable(
            f"TTFT target {objective.ttft_ms:g} ms cannot be met by model '{model}': one step alone takes "
            f"{report.min_ttft_s * 1000:.1f} ms on its fastest worker")
    if report.min_ttft_s > 0 and objective.tpot_ms / 1000 < report.min_ttft_s:
        raise TpotUnmeetable(
            f"TPOT target {objective.tpot_ms:g} ms cannot be met by model '{model}': one step alone takes "
            f"{report.min_ttft_s * 1000:.1f} ms on its fastest worker")
    predicted_s = report.ttft_s(priority)
    if predicted_s is not None and predicted_s + waited_s > target_s:
        retry_after_s = max(predicted_s - target_s, MIN_RETRY_AFTER_S)
        waited = f" after {waited_s * 1000:.0f} ms before the gateway" if waited_s > 0 else ""
        raise ObjectiveMissed(
            f"overloaded: model '{model}' would start a {priority.name.lower()} stream in "
            f"{predicted_s * 1000:.0f} ms at best{waited}, past its TTFT target {objective.ttft_ms:g} ms; "
            f"retry after {retry_after_s:.2f} s", retry_after_s=retry_after_s)
