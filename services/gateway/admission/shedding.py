"""Load shedding: refuse early, by priority, what the mesh cannot serve well.

Inputs are the schedulers' pressure reports (per model: estimated queue time
per priority, KV usage) and the gateway's own in-flight utilization. Each
signal maps to a shed level with two thresholds:

    level 0: admit everything
    level 1: shed SHEDDABLE
    level 2: shed SHEDDABLE and STANDARD

* queue signal: critical's estimated queue time as a fraction of its SLO, so
  lower classes are shed *before* critical traffic starts missing its SLO;
* KV signal: KV-cache usage (generators), before preemption storms start;
* in-flight signal: the gateway's concurrency in use, keeping the last slots
  for critical traffic.

CRITICAL is never shed by level; it (like every class) is shed only when its
own estimated queue time already exceeds its SLO, because a request that will
miss its SLO anyway is better refused at once than left to wait.

Stale reports (older than `max_report_age_s`) are ignored: without fresh
feedback the gateway admits (fail open) and leans on the in-flight signal.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.errors import ResourceExhausted
from services.common.priority import Priority
from services.gateway.routing.pressure import PressureBoard, PressureReport


class ShedReason(enum.Enum):
    ADMITTED = "admitted"
    QUEUE_TIME = "queue_time"
    KV_USAGE = "kv_usage"
    GATEWAY_IN_FLIGHT = "gateway_in_flight"
    OVER_SLO = "over_slo"


@dataclass(frozen=True)
class ShedThresholds:
    # Signal value at which SHEDDABLE, then also STANDARD, are shed.
    shed_sheddable_at: float
    shed_standard_at: float

    def level(self, value: float) -> int:
        if value >= self.shed_standard_at:
            return 2
        return 1 if value >= self.shed_sheddable_at else 0


@dataclass(frozen=True)
class SheddingConfig:
    queue_slo_s: Mapping[Priority, float] = field(
        default_factory=lambda: {Priority.CRITICAL: 0.5, Priority.STANDARD: 2.0, Priority.SHEDDABLE: 5.0}
    )
    # Critical's estimated queue time / its SLO.
    queue: ShedThresholds = ShedThresholds(0.5, 0.8)
    kv_usage: ShedThresholds = ShedThresholds(0.90, 0.97)
    gateway_in_flight: ShedThresholds = ShedThresholds(0.8, 0.9)
    min_retry_after_s: float = 0.1
    max_retry_after_s: float = 10.0

    def __post_init__(self) -> None:
        missing = [p.name.lower() for p in Priority if p not in self.queue_slo_s]
        if missing:
            raise ValueError(f"queue_slo_s needs an SLO for every priority; missing {', '.join(missing)}")
        if any(not slo_s > 0 for slo_s in self.queue_slo_s.values()):
            raise ValueError(f"queue_slo_s values must be > 0, got {dict(self.queue_slo_s)}")
        for name in ("queue", "kv_usage", "gateway_in_flight"):
            thresholds: ShedThresholds = getattr(self, name)
            if not 0 < thresholds.shed_sheddable_at <= thresholds.shed_standard_at:
                raise ValueError(f"{name}: need 0 < shed_sheddable_at <= shed_standard_at, got {thresholds}")
        if not 0 < self.min_retry_after_s <= self.max_retry_after_s:
            raise ValueError("need 0 < min_retry_after_s <= max_retry_after_s")


@dataclass(frozen=True)
class ShedDecision:
    admit: bool
    reason: ShedReason
    # Set when not admitted: when the caller should try again.
    retry_after_s: float | None = None
    # Which signal and values decided it, for the error message and logs.
    detail: str = ""


_ADMIT = ShedDecision(admit=True, reason=ShedReason.ADMITTED)
# The lowest shed level at which each priority is refused; CRITICAL never by level.
_SHED_FROM_LEVEL = {Priority.SHEDDABLE: 1, Priority.STANDARD: 2, Priority.CRITICAL: 3}


class LoadShedder:
    def __init__(self, config: SheddingConfig, board: PressureBoard) -> None:
        self.config = config
        self.board = board

    def decide(self, model: str, priority: Priority, gateway_utilization: float) -> ShedDecision:
        report = self.board.pressure(model)
        if report is not None and report.num_workers == 0:
            # No worker anywhere (a roll or restart moving them, or none yet) is not overload: its
            # "queue time" is the no-worker sentinel. Each scheduler answers for itself ("no worker",
            # "not served here") and the dispatcher fails over or regroups; shedding would refuse
            # every call for its 10 s retry hint.
            report = None
        own_queue_s = 0.0 if report is None else report.queue_time_s(priority)
        for reason, level, detail in self._signals(report, gateway_utilization):
            if level >= _SHED_FROM_LEVEL[priority]:
                return self._shed(reason, detail(), own_queue_s)
        slo_s = self.config.queue_slo_s[priority]
        if own_queue_s > slo_s:
            return self._shed(
                ShedReason.OVER_SLO,
                f"estimated queue time {own_queue_s:.3f} s exceeds the {slo_s:g} s SLO",
                own_queue_s,
            )
        return _ADMIT

    def check(self, model: str, priority: Priority, gateway_utilization: float) -> None:
        """Raise ResourceExhausted (with a retry hint) when the request is shed."""
        decision = self.decide(model, priority, gateway_utilization)
        if not decision.admit:
            raise ResourceExhausted(
                f"overloaded: shedding {priority.name.lower()} traffic for model '{model}' "
                f"({decision.detail}); retry after {decision.retry_after_s:.2f} s",
                retry_after_s=decision.retry_after_s,
            )

    def _signals(self, report: PressureReport | None, gateway_utilization: float):
        """(reason, level, detail) per signal; details are built only when something is shed."""
        config = self.config
        yield (
            ShedReason.GATEWAY_IN_FLIGHT,
            config.gateway_in_flight.level(gateway_utilization),
            lambda: f"gateway concurrency {gateway_utilization:.0%} in use",
        )
        if report is None:
            return
        critical_queue_s = report.queue_time_s(Priority.CRITICAL)
        critical_slo_s = config.queue_slo_s[Priority.CRITICAL]
        yield (
            ShedReason.QUEUE_TIME,
            config.queue.level(critical_queue_s / critical_slo_s),
            lambda: f"critical queue time {critical_queue_s:.3f} s of its {critical_slo_s:g} s SLO",
        )
        yield (
            ShedReason.KV_USAGE,
            config.kv_usage.level(report.kv_usage),
            lambda: f"KV cache {report.kv_usage:.0%} used",
        )

    def _shed(self, reason: ShedReason, detail: str, own_queue_s: float) -> ShedDecision:
        # Ask the caller to come back about when today's queue for its class has drained.
        retry_after_s = min(max(own_queue_s, self.config.min_retry_after_s), self.config.max_retry_after_s)
        return ShedDecision(admit=False, reason=reason, retry_after_s=retry_after_s, detail=detail)
