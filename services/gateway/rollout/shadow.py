"""Shadow traffic: mirror a share of a model's version-less requests to its candidate version.

At a rollout's shadow step (rollout/controller.py), once the primary has answered, a share of the
requests are sent again to the candidate version, and the two answers are compared:

  classify  the same top label, and its score within max_score_drift
  generate  greedy requests only (temperature 0: the answer is a function of the prompt); the
            same tokens, compared up to the first divergence

What the client sees never depends on the shadow: the mirror starts after the client has its
answer (a task nobody awaits), its errors are only counted, and it is
  * sheddable-class: the scheduler queues it as `sheddable`, and it is not sent at all when the
    gateway would shed a sheddable request for the model now (`admits_sheddable`);
  * capped by a budget: at most the policy's shadow_max_in_flight mirrored calls per model;
  * outside the tenant's quota and the model's adaptive limit (it never passes admission), and
    outside the breakers: its outcome is reported to no endpoint's circuit breaker, so a broken
    candidate cannot make the primary's scheduler look unhealthy.
Outcomes land in infermesh_gateway_shadow_requests_total and, as samples with their agreement,
in the canary's rollout window.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common.errors import InfermeshError
from services.gateway.rollout.controller import RolloutController, ShadowTarget
from services.gateway.rollout.side_calls import (
    RouteChooser,
    error_code,
    pinned_client,
    sheddable_tenant,
    tokens_while_matching,
)
from services.gateway.telemetry import metrics
from services.gateway.upstream.clients import AttemptError, SchedulerClients

log = logging.getLogger(__name__)


def labels_agree(primary: Sequence[common_pb2.Label], shadow: Sequence[common_pb2.Label],
                 max_score_drift: float) -> bool:
    """Same top label, and its score within `max_score_drift`."""
    if not primary or not shadow:
        return not primary and not shadow
    return primary[0].label == shadow[0].label and abs(primary[0].score - shadow[0].score) <= max_score_drift


def tokens_agree(primary: Sequence[int], shadow: Sequence[int]) -> tuple[bool, int]:
    """(whether the streams agree, how many tokens matched before the first divergence)."""
    matched = 0
    for a, b in zip(primary, shadow, strict=False):
        if a != b:
            break
        matched += 1
    return matched == len(primary) == len(shadow), matched


class ShadowMirror:
    def __init__(self, rollouts: RolloutController, routing: RouteChooser, clients: SchedulerClients, *,
                 admits_sheddable: Callable[[str], bool], timeout_s: float,
                 max_score_drift: Callable[[str], float], rng: Callable[[], float] = random.random,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._rollouts = rollouts
        self._routing = routing
        self._clients = clients
        self._admits_sheddable = admits_sheddable
        self._timeout_s = timeout_s
        self._max_score_drift = max_score_drift
        self._rng = rng
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._tasks: set[asyncio.Task] = set()

    def wants(self, model: str, requested_version: str) -> ShadowTarget | None:
        """The shadow target for a version-less request of `model`, or None."""
        return None if requested_version else self._rollouts.shadow_target(model)

    def classify(self, model: str, request: gateway_pb2.ClassifyRequest, primary: gateway_pb2.ClassifyResponse,
                 tenant_id: str) -> None:
        target = self._admit(model, request.model.version)
        if target is None:
            return
        mirrored = gateway_pb2.ClassifyRequest()
        mirrored.CopyFrom(request)
        mirrored.model.version = target.version
        upstream = scheduler_pb2.ScheduleClassifyRequest(request=mirrored, tenant=sheddable_tenant(tenant_id))
        labels = list(primary.labels)
        self._spawn(model, target, self._classify(model, target, upstream, labels))

    def generate(self, model: str, request: gateway_pb2.GenerateRequest, primary_tokens: Sequence[int],
                 tenant_id: str) -> None:
        """A finished greedy stream (the caller checks temperature 0) and the tokens it sent."""
        target = self._admit(model, request.model.version)
        if target is None:
            return
        mirrored = gateway_pb2.GenerateRequest()
        mirrored.CopyFrom(request)
        mirrored.model.version = target.version
        mirrored.ClearField("stream")
        upstream = scheduler_pb2.ScheduleGenerateRequest(request=mirrored, tenant=sheddable_tenant(tenant_id))
        self._spawn(model, target, self._generate(model, target, upstream, tuple(primary_tokens)))

    def _admit(self, model: str, requested_version: str) -> ShadowTarget | None:
        target = self.wants(model, requested_version)
        if target is None or self._rng() * 100 >= target.percent:
            return None
        if self._in_flight.get(model, 0) >= target.max_in_flight or not self._admits_sheddable(model):
            metrics.SHADOW_REQUESTS.labels(model, target.version, "shed").inc()
            return None
        return target

    def _spawn(self, model: str, target: ShadowTarget, work) -> None:
        self._in_flight[model] = self._in_flight.get(model, 0) + 1
        task = asyncio.get_running_loop().create_task(work, name=f"shadow {model} {target.version}")
        self._tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self._tasks.discard(finished)
            self._in_flight[model] -= 1

        task.add_done_callback(done)

    async def _classify(self, model: str, target: ShadowTarget, upstream: scheduler_pb2.ScheduleClassifyRequest,
                        primary: list[common_pb2.Label]) -> None:
        began_s = self._clock()
        try:
            client = pinned_client(self._routing, self._clients, model, target.version)
            reply = await client.classify(upstream, self._timeout_s)
        except (AttemptError, InfermeshError) as exc:
            self._failed(model, target, exc, began_s)
            return
        agreed = labels_agree(primary, reply.labels, self._max_score_drift(model))
        self._finished(model, target, began_s, reply.timings.stages, agreed)

    async def _generate(self, model: str, target: ShadowTarget, upstream: scheduler_pb2.ScheduleGenerateRequest,
                        primary: tuple[int, ...]) -> None:
        began_s = self._clock()
        try:
            client = pinned_client(self._routing, self._clients, model, target.version)
            tokens, stages = await tokens_while_matching(client.generate(upstream, self._timeout_s), primary)
        except (AttemptError, InfermeshError) as exc:
            self._failed(model, target, exc, began_s)
            return
        agreed, _ = tokens_agree(primary, tokens)
        self._finished(model, target, began_s, stages, agreed)

    def _finished(self, model: str, target: ShadowTarget, began_s: float, stages, agreed: bool) -> None:
        metrics.SHADOW_REQUESTS.labels(model, target.version, "agreed" if agreed else "disagreed").inc()
        self._rollouts.record_shadow(model, target.version, "OK", self._clock() - began_s,
                                     metrics.stage_samples(stages), agreed=agreed)

    def _failed(self, model: str, target: ShadowTarget, exc: AttemptError | InfermeshError, began_s: float) -> None:
        code = error_code(exc)
        metrics.SHADOW_REQUESTS.labels(model, target.version, "failed").inc()
        log.debug("shadow call to %s version %s failed: %s", model, target.version, code)
        self._rollouts.record_shadow(model, target.version, code, self._clock() - began_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

