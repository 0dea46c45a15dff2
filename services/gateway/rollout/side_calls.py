"""Calls the gateway makes on its own behalf to one pinned version: shadow mirroring (shadow.py)
and a rollout's golden cases (rollout/probe.py). Both are sheddable-class at the scheduler, pass
no admission (no quota, no concurrency limit) and report to no circuit breaker."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.errors import InfermeshError
from services.common.priority import Priority
from services.common.status import status_code_of
from services.gateway.upstream.clients import AttemptError, GenerateCall, SchedulerClient, SchedulerClients
from services.gateway.upstream.scheduler_stream import StreamGenerateCall


class _Permit(Protocol):
    def abandon(self) -> None: ...


class PinnedRoute(Protocol):
    @property
    def endpoint(self) -> str: ...

    @property
    def permit(self) -> _Permit: ...


class RouteChooser(Protocol):
    """The routing table as side calls use it (routing/table.py's RoutingTable.choose): the rollout
    package sits below routing and is handed the table, never imports it."""

    def choose(self, model: str, version: str = "", *, priority: Priority = Priority.STANDARD) -> PinnedRoute: ...


def sheddable_tenant(tenant_id: str) -> scheduler_pb2.TenantContext:
    return scheduler_pb2.TenantContext(tenant_id=tenant_id, priority=common_pb2.PRIORITY_SHEDDABLE, weight=1)


def pinned_client(routing: RouteChooser, clients: SchedulerClients, model: str, version: str) -> SchedulerClient:
    """The scheduler client serving `version` of `model` for a sheddable side call. Raises what
    RoutingTable.choose raises (no endpoint, an open breaker)."""
    route = routing.choose(model, version, priority=Priority.SHEDDABLE)
    route.permit.abandon()  # a side call's outcome says nothing to the breakers
    return clients.get(route.endpoint)


def error_code(exc: AttemptError | InfermeshError) -> str:
    """The gRPC status code name a failed side call ended with."""
    return exc.code.name if isinstance(exc, AttemptError) else status_code_of(exc).name


async def tokens_while_matching(call: GenerateCall | StreamGenerateCall,
                                expected: Sequence[int]) -> tuple[list[int], Sequence[common_pb2.StageTiming]]:
    """Streams `call` until it ends or its tokens diverge from `expected` (the rest is not worth
    computing), then cancels it: the tokens received, and the stage timings of its last chunk
    (empty when it did not finish)."""
    tokens: list[int] = []
    stages: Sequence[common_pb2.StageTiming] = ()
    try:
        async for chunk in call.chunks():
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                stages = chunk.timings.stages
            if tokens[:len(expected)] != list(expected[:len(tokens)]):
                break
    finally:
        call.cancel()
    return tokens, stages

