"""Sends a rollout's golden cases to its canary version: the gateway side of rollout/golden.py.

Each case goes the way a client's request goes past admission (gateway -> scheduler -> the
version's workers), pinned to the canary version, and like a shadow call (shadow.py) it is
  * sheddable-class at the scheduler, and not sent at all while the gateway would shed a sheddable
    request for the model (the case is then unanswered, and the run is tried again);
  * charged to no tenant: it never passes admission (no quota, no concurrency limit), and the
    scheduler queues it under its own tenant, GOLDEN_TENANT, so it takes no tenant's fair share;
  * reported to no circuit breaker.
Cases run one after another: a handful of calls every interval, never a burst.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common.errors import InfermeshError
from services.gateway.rollout.golden import CaseAnswer, GoldenCase, GoldenImage, GoldenPrompt
from services.gateway.rollout.side_calls import (
    RouteChooser,
    error_code,
    pinned_client,
    sheddable_tenant,
    tokens_while_matching,
)
from services.gateway.upstream.clients import AttemptError, SchedulerClients

GOLDEN_TENANT = "infermesh-rollout-golden"


class RoutedGoldenProber:
    def __init__(self, routing: RouteChooser, clients: SchedulerClients, *,
                 admits_sheddable: Callable[[str], bool], timeout_s: float) -> None:
        self._routing = routing
        self._clients = clients
        self._admits_sheddable = admits_sheddable
        self._timeout_s = timeout_s

    async def answers(self, model: str, version: str, cases: Sequence[GoldenCase]) -> list[CaseAnswer]:
        return [await self._answer(model, version, case) for case in cases]

    async def _answer(self, model: str, version: str, case: GoldenCase) -> CaseAnswer:
        if not self._admits_sheddable(model):
            return CaseAnswer(code="RESOURCE_EXHAUSTED", message="shed: the gateway sheds sheddable traffic now")
        try:
            client = pinned_client(self._routing, self._clients, model, version)
            if isinstance(case, GoldenImage):
                reply = await client.classify(_classify(model, version, case), self._timeout_s)
                return CaseAnswer(top1=reply.labels[0].index if reply.labels else None)
            call = client.generate(_generate(model, version, case), self._timeout_s)
            tokens, _ = await tokens_while_matching(call, case.expected_ids)
            return CaseAnswer(token_ids=tuple(tokens))
        except (AttemptError, InfermeshError) as exc:
            return CaseAnswer(code=error_code(exc), message=str(exc))


def _classify(model: str, version: str, case: GoldenImage) -> scheduler_pb2.ScheduleClassifyRequest:
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=case.pixels, height=case.height, width=case.width,
                                                     channels=case.channels))
    request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=model, version=version), image=image,
                                          top_k=1, request_id=f"rollout-golden-{uuid.uuid4().hex}")
    return scheduler_pb2.ScheduleClassifyRequest(request=request, tenant=sheddable_tenant(GOLDEN_TENANT))


def _generate(model: str, version: str, case: GoldenPrompt) -> scheduler_pb2.ScheduleGenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=len(case.expected_ids), temperature=0.0)
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=model, version=version), prompt=case.prompt,
                                          sampling=sampling, request_id=f"rollout-golden-{uuid.uuid4().hex}")
    return scheduler_pb2.ScheduleGenerateRequest(request=request, tenant=sheddable_tenant(GOLDEN_TENANT))
