"""What happened to each request a load plan sent: the load engine's results, and the generator's lag.

Times are seconds from the plan's start; latency runs from the *scheduled* send time (open loop, so a
late generator or a slow server is charged to the request, never hidden).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.harness.stats import quantile

OK = "OK"


@dataclass(frozen=True, slots=True)
class SendResult:
    """What happened to one request; times are seconds from the plan's start."""

    tenant: str
    scheduled_s: float
    sent_s: float
    done_s: float
    status: str  # gRPC code name
    leaf_stage_us: int = 0  # sum of the reply's leaf stage timings (0 when it failed)
    ttft_s: float | None = None  # first token chunk, from the scheduled time (streams)
    num_tokens: int = 0
    message: str = ""  # the status details of a failure
    predicted_ttft_s: float | None = None  # what the gateway predicted at admission (streams with objectives)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def latency_s(self) -> float:
        return self.done_s - self.scheduled_s

    @property
    def lag_s(self) -> float:
        """How late the load generator sent it."""
        return max(0.0, self.sent_s - self.scheduled_s)


def merge_results(parts: Iterable[Sequence[SendResult]]) -> list[SendResult]:
    """The load processes' results as one run, in scheduled order."""
    return sorted((r for part in parts for r in part), key=lambda r: r.scheduled_s)


def in_window(results: Iterable[SendResult], start_s: float, end_s: float) -> list[SendResult]:
    """Results scheduled in [start_s, end_s): the measured period, without warm-up."""
    return [r for r in results if start_s <= r.scheduled_s < end_s]


@dataclass(frozen=True)
class LagSummary:
    p50_ms: float
    p99_ms: float
    max_ms: float
    threshold_ms: float

    @property
    def fell_behind(self) -> bool:
        """The generator's p99 lag exceeds the threshold: it offered less than the plan asked."""
        return self.p99_ms > self.threshold_ms


def lag_summary(results: Sequence[SendResult], threshold_ms: float) -> LagSummary:
    lags_ms = [1000 * r.lag_s for r in results]
    return LagSummary(quantile(lags_ms, 0.5), quantile(lags_ms, 0.99), max(lags_ms, default=math.nan), threshold_ms)
