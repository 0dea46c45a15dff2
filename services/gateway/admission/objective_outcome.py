"""Did a served stream meet its latency objective? And how far was the predicted TTFT from the one measured?

A stream's TTFT is measured at the gateway from the request's arrival to its first token sent, and
its TPOT as the time from the first token to the last over the tokens after the first (a stream of
one token has no TPOT and is judged on TTFT alone). Each finished stream with an objective counts
once under its class: met (both), or which it missed. The share meeting both per class is
`met / all` of `infermesh_gateway_objective_streams_total`.

`TtftMeans` keeps, per (model, class), a smoothed mean of the TTFT admission predicted (the best
scheduler's, for a one-token prompt: a lower bound) and of the TTFT measured, for the gauge that
makes the predictor's error visible.

Pure: no clock, no metrics client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.objectives import LatencyObjective

# Weight of one new stream in the smoothed means: about the last 20 streams.
SMOOTHING = 0.05
# Model labels come from clients (bounded by metric_labels, "_other" for unknown ones): a hard cap anyway.
_MAX_SERIES = 10_000


class ObjectiveOutcome(enum.Enum):
    MET = "met"
    MISSED_TTFT = "missed_ttft"
    MISSED_TPOT = "missed_tpot"
    MISSED_BOTH = "missed_both"


@dataclass(frozen=True)
class StreamLatency:
    ttft_s: float
    # None: one token, no time between tokens.
    tpot_s: float | None


def measure(began_s: float, first_token_s: float, last_token_s: float, num_tokens: int) -> StreamLatency:
    tpot_s = (last_token_s - first_token_s) / (num_tokens - 1) if num_tokens > 1 else None
    return StreamLatency(ttft_s=first_token_s - began_s, tpot_s=tpot_s)


def judge(objective: LatencyObjective, latency: StreamLatency) -> ObjectiveOutcome:
    ttft_met = latency.ttft_s * 1000 <= objective.ttft_ms
    tpot_met = latency.tpot_s is None or latency.tpot_s * 1000 <= objective.tpot_ms
    if ttft_met and tpot_met:
        return ObjectiveOutcome.MET
    if tpot_met:
        return ObjectiveOutcome.MISSED_TTFT
    return ObjectiveOutcome.MISSED_TPOT if ttft_met else ObjectiveOutcome.MISSED_BOTH


class TtftMeans:
    """Smoothed predicted and measured TTFT per key; a key's first value is taken as it is."""

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self._smoothing = smoothing
        self._means: dict[tuple[str, str, str], float] = {}

    def add(self, model: str, priority: str, source: str, seconds: float) -> float:
        """Adds one stream's value; returns the key's new mean."""
        key = (model, priority, source)
        old = self._means.get(key)
        if old is None and len(self._means) >= _MAX_SERIES:
            self._means.clear()
        mean = seconds if old is None else old + self._smoothing * (seconds - old)
        self._means[key] = mean
        return mean
