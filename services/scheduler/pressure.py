"""How loaded one model is, for the gateway's load shedding (infermesh.v1.ModelPressure).

Estimates come from the batchers' own state: what is queued at or above each
priority class, and measured batch / step times. They are deliberately rough
and pessimistic for the class that is flooding: the gateway only needs to know
which classes to shed before queues explode.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from services.scheduler.dynamic_batcher import DynamicBatcher
from services.scheduler.fair_queue import Priority
from services.scheduler.step_scheduler import StepScheduler

# Reported instead of "forever" (no worker attached), so the wire value stays finite.
MAX_QUEUE_TIME_S = 3600.0


@dataclass(frozen=True)
class ModelPressure:
    # Estimated wait before a new request of each class is scheduled, seconds (<= MAX_QUEUE_TIME_S).
    est_queue_time_s: Mapping[Priority, float]
    # Classify items queued, or generate sequences waiting for admission (incl. preempted).
    queue_depth: int
    # Fraction of KV blocks in use across the model's workers, [0, 1]; 0 for classifiers.
    kv_usage: float
    num_workers: int
    # Recent shortest service time of one request (one batch of 1, or one step), seconds.
    min_service_time_s: float
    # Requests the workers keep busy with (running + prefetched batches; running sequences + half as many
    # waiting to refill slots freed between steps). The gateway never limits concurrency below it.
    num_slots: int = 0
    # Generate: predicted time to first token of a new one-token prompt of each class on the best worker,
    # seconds (latency_predictor.py); empty for classifiers.
    predicted_ttft_s: Mapping[Priority, float] = field(default_factory=dict)
    # Generate: one step computing one token alone on the fastest worker, seconds; 0 unknown.
    min_ttft_s: float = 0.0
    # Generate: predicted_ttft_s's growth per typical stream queued ahead after this report, per class
    # (StepScheduler.ttft_per_queued_s), on the worker whose prediction it is; empty for classifiers.
    ttft_per_queued_s: Mapping[Priority, float] = field(default_factory=dict)
    # Generate: how much a new stream's predicted TTFT grows per token of its own prompt (its prefill), seconds,
    # on the fastest worker (StepScheduler.ttft_per_prompt_token_s); 0: unknown, or a classifier.
    ttft_per_prompt_token_s: float = 0.0

    def est_queue_time_us_by_priority(self) -> list[int]:
        """ModelPressure.est_queue_time_us: indexed by Priority value, index 0 (UNSPECIFIED) unused."""
        return _us_by_priority(self.est_queue_time_s)

    def predicted_ttft_us_by_priority(self) -> list[int]:
        """ModelPressure.predicted_ttft_us, indexed like est_queue_time_us; empty when none predicted."""
        return _us_by_priority(self.predicted_ttft_s) if self.predicted_ttft_s else []

    def ttft_per_queued_us_by_priority(self) -> list[int]:
        """ModelPressure.ttft_per_queued_us, indexed like predicted_ttft_us; empty when none predicted."""
        return _us_by_priority(self.ttft_per_queued_s) if self.ttft_per_queued_s else []


def _us_by_priority(seconds_by_priority: Mapping[Priority, float]) -> list[int]:
    by_value = [0] * (max(Priority) + 1)
    for priority, seconds in seconds_by_priority.items():
        by_value[priority] = round(seconds * 1e6)
    return by_value


def classifier_pressure(batcher: DynamicBatcher) -> ModelPressure:
    return ModelPressure(
        est_queue_time_s={p: _capped(batcher.estimated_queue_time_s(p)) for p in Priority},
        queue_depth=batcher.queue_depth,
        kv_usage=0.0,
        num_workers=batcher.num_usable_workers,  # a draining worker serves nothing new
        min_service_time_s=batcher.min_service_time_s(),
        num_slots=batcher.num_slots,
    )


def generator_pressure(schedulers: Collection[StepScheduler]) -> ModelPressure:
    """One StepScheduler per attached worker; a new sequence goes to the least loaded one."""
    if not schedulers:
        return ModelPressure(
            est_queue_time_s={p: MAX_QUEUE_TIME_S for p in Priority},
            queue_depth=0,
            kv_usage=0.0,
            num_workers=0,
            min_service_time_s=0.0,
        )
    num_blocks = sum(s.kv.num_blocks for s in schedulers)
    # Per class, the worker a new stream of it would start soonest on, and that prediction: each computed once.
    best = {p: _soonest(schedulers, p) for p in Priority}
    return ModelPressure(
        est_queue_time_s={p: _capped(min(s.estimated_queue_time_s(p) for s in schedulers)) for p in Priority},
        queue_depth=sum(s.num_waiting for s in schedulers),
        kv_usage=sum(s.kv.num_used_blocks for s in schedulers) / num_blocks,
        num_workers=len(schedulers),
        min_service_time_s=min(s.step_time_s for s in schedulers),
        num_slots=sum(s.config.max_num_seqs * 3 // 2 for s in schedulers),
        predicted_ttft_s={p: _capped(best[p][1]) for p in Priority},
        min_ttft_s=min(s.latency.min_ttft_s() for s in schedulers),
        # New streams spread over the workers (prefix_routing.py), so the best prediction grows by about
        # its worker's slope over the number of workers per stream admitted.
        ttft_per_queued_s={p: _capped(best[p][0].ttft_per_queued_s(p, best[p][1])) / len(schedulers)
                           for p in Priority},
        ttft_per_prompt_token_s=min(s.ttft_per_prompt_token_s() for s in schedulers),
    )


def _soonest(schedulers: Collection[StepScheduler], priority: Priority) -> tuple[StepScheduler, float]:
    """The worker's scheduler a new `priority` stream is predicted to start soonest on, and that TTFT."""
    predicted = [(scheduler.predicted_latency(priority).ttft_s, scheduler) for scheduler in schedulers]
    ttft_s, scheduler = min(predicted, key=lambda pair: pair[0])
    return scheduler, ttft_s


def _capped(seconds: float) -> float:
    return MAX_QUEUE_TIME_S if math.isinf(seconds) else min(seconds, MAX_QUEUE_TIME_S)
