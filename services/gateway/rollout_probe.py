"""Sends a rollout's golden cases to its canary version: the gateway side of rollout_golden.py.

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
from services.common.status import status_code_of
from services.gateway.rollout_golden import CaseAnswer, GoldenCase, GoldenImage, GoldenPrompt
from services.gateway.routing import RoutingTable
from services.gateway.tenants import Priority
from services.gateway.upstream import AttemptError, SchedulerClients

GOLDEN_TENANT = "infermesh-rollout-golden"


class RoutedGoldenProber:
    def __init__(self, routing: RoutingTable, clients: SchedulerClients, *,
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
            route = self._routing.choose(model, version, priority=Priority.SHEDDABLE)
            route.permit.abandon()  # a golden case's outcome says nothing to the breakers
            client = self._clients.get(route.endpoint)
            if isinstance(case, GoldenImage):
                reply = await client.classify(_classify(model, version, case), self._timeout_s)
                return CaseAnswer(top1=reply.labels[0].index if reply.labels else None)
            return CaseAnswer(token_ids=await self._generate(client, model, version, case))
        except AttemptError as exc:
            return CaseAnswer(code=exc.code.name, message=str(exc))
        except InfermeshError as exc:
            return CaseAnswer(code=status_code_of(exc).name, message=str(exc))

    async def _generate(self, client, model: str, version: str, case: GoldenPrompt) -> tuple[int, ...]:
        tokens: list[int] = []
        call = client.generate(_generate(model, version, case), self._timeout_s)
        try:
            async for chunk in call.chunks():
                tokens.extend(chunk.token_ids)
                if tokens[:len(case.expected_ids)] != list(case.expected_ids[:len(tokens)]):
                    break  # diverged: the rest is not worth computing
        finally:
            call.cancel()
        return tuple(tokens)


def _tenant() -> scheduler_pb2.TenantContext:
    return scheduler_pb2.TenantContext(tenant_id=GOLDEN_TENANT, priority=common_pb2.PRIORITY_SHEDDABLE, weight=1)


def _classify(model: str, version: str, case: GoldenImage) -> scheduler_pb2.ScheduleClassifyRequest:
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=case.pixels, height=case.height, width=case.width,
                                                     channels=case.channels))
    request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name=model, version=version), image=image,
                                          top_k=1, request_id=f"rollout-golden-{uuid.uuid4().hex}")
    return scheduler_pb2.ScheduleClassifyRequest(request=request, tenant=_tenant())


def _generate(model: str, version: str, case: GoldenPrompt) -> scheduler_pb2.ScheduleGenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=len(case.expected_ids), temperature=0.0)
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name=model, version=version), prompt=case.prompt,
                                          sampling=sampling, request_id=f"rollout-golden-{uuid.uuid4().hex}")
    return scheduler_pb2.ScheduleGenerateRequest(request=request, tenant=_tenant())
