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

A gateway that makes a class wait past its target before the handler runs is starved for every
lower class too: left alone, the lower classes' looser targets still pass, they take the worker
and the gateway's CPU, and the higher class is refused instead (bench_slo tinylm 4x: 2122
interactive streams refused, 674 batch streams served). So once a stream is refused for its wait
(admitted on the prediction alone), `StarvedGateway` sheds the strictly lower classes of that model
for `STARVED_SHED_S`: sheddable streams go first here as everywhere.

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


class WaitedPastObjective(ObjectiveMissed):
    """Predicted to meet the TTFT target, but not after what it waited before the gateway's handler ran."""


# A refused request is told to come back no sooner than this (the next pressure poll may differ).
MIN_RETRY_AFTER_S = 0.05
# Lower classes are shed this long after a higher one was refused for its wait before the handler.
STARVED_SHED_S = 1.0


def check_ttft(model: str, priority: Priority, objective: LatencyObjective, report: PressureReport | None, *,
               waited_s: float = 0.0, predicted_s: float | None = None, median_s: float | None = None) -> None:
    """Raises FailedPrecondition (never meetable) or ResourceExhausted (predicted miss everywhere).
    `waited_s`: what the request already spent before the gateway's handler ran (its ingress, from the
    client's `x-request-start`): its first token reaches the client that much later than predicted.
    `predicted_s`: its predicted TTFT when the caller knows better than the report alone (the streams
    admitted since it, PressureBoard.predicted_ttft_s; a quantile of it, ttft_calibration.py); None: the report's.
    `median_s`: that prediction's median when `predicted_s` is a quantile above it. A stream refused with a
    prediction that alone meets the target is refused for its wait (WaitedPastObjective, which starves the
    classes below) only when its median plus the wait misses too: a prediction at the target's edge tipped by a
    few milliseconds of ingress is the prediction's spread, not a starved gateway (bench_slo, the mock at 1x:
    2-8 ms waits on interactive streams judged at 196-199 ms shed 274 batch streams in 60 s)."""
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
    if predicted_s is None:
        predicted_s = report.ttft_s(priority)
    if predicted_s is not None and predicted_s + waited_s > target_s:
        retry_after_s = max(predicted_s - target_s, MIN_RETRY_AFTER_S)
        waited = f" after {waited_s * 1000:.0f} ms before the gateway" if waited_s > 0 else ""
        central_s = predicted_s if median_s is None else min(median_s, predicted_s)
        starved = predicted_s <= target_s and central_s + waited_s > target_s
        error = WaitedPastObjective if starved else ObjectiveMissed
        raise error(
            f"overloaded: model '{model}' would start a {priority.name.lower()} stream in "
            f"{predicted_s * 1000:.0f} ms at best{waited}, past its TTFT target {objective.ttft_ms:g} ms; "
            f"retry after {retry_after_s:.2f} s", retry_after_s=retry_after_s)


class StarvedGateway:
    """Sheds the classes below one refused for its wait before the handler, per model (module docstring).
    Pure: the caller passes the time."""

    def __init__(self, shed_s: float = STARVED_SHED_S) -> None:
        self._shed_s = shed_s
        # model -> (the highest class refused for its wait, until when those below it are shed, that wait)
        self._starved: dict[str, tuple[Priority, float, float]] = {}

    def refused(self, model: str, priority: Priority, waited_s: float, now_s: float) -> None:
        """A `priority` stream of `model` was refused for its wait (WaitedPastObjective) at `now_s`."""
        current = self._starved.get(model)
        if current is not None and current[1] > now_s and current[0] < priority:
            return  # a higher class is already shedding this one and those below
        self._starved[model] = (priority, now_s + self._shed_s, waited_s)

    def check(self, model: str, priority: Priority, now_s: float) -> None:
        """Raises ResourceExhausted when a class above `priority` was refused for its wait lately."""
        starved = self._starved.get(model)
        if starved is None:
            return
        above, until_s, waited_s = starved
        if now_s >= until_s:
            del self._starved[model]
        elif above < priority:
            retry_after_s = until_s - now_s
            raise ResourceExhausted(
                f"overloaded: shedding {priority.name.lower()} traffic for model '{model}' ({above.name.lower()} "
                f"streams wait {waited_s * 1000:.0f} ms before the gateway, past their TTFT target); retry after "
                f"{retry_after_s:.2f} s", retry_after_s=retry_after_s)
