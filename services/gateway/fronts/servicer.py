"""Gateway gRPC servicer (infermesh.v1.Inference): validate, admit, dispatch with retries, account."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Callable

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from services.common import errors
from services.common.deadlines import remaining_s
from services.common.log_context import bind
from services.common.status import maps_domain_errors
from services.gateway.admission.admission import Admission, RequestScope
from services.gateway.calls.generate_core import (
    GenerateCore,
    HandlerTimes,
    append_gateway_timings,
    fix_seed,  # noqa: F401 - re-exported: tests and callers import it from here
    tenant_context,
)
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.retry_policy import WorkKind
from services.gateway.fronts.caller import grpc_authorization, grpc_caller
from services.gateway.rollout.shadow import ShadowMirror
from services.gateway.telemetry.tracing import span
from services.gateway.upstream.clients import AttemptError, SchedulerClients


def _require_model_name(name: str) -> None:
    if not name:
        raise errors.InvalidArgument("model.name is required")


class InferenceServicer(gateway_pb2_grpc.InferenceServicer):
    def __init__(
        self, admission: Admission, dispatcher: Dispatcher, clients: SchedulerClients, clock=time.monotonic,
        seed_source: Callable[[], int] = lambda: secrets.randbits(63), shadow: ShadowMirror | None = None,
    ) -> None:
        """shadow: mirrors answered version-less requests at a rollout's shadow step (shadow.py)."""
        self._admission = admission
        self._dispatcher = dispatcher
        self._clients = clients
        self._clock = clock
        self._shadow = shadow
        self.generate_core = GenerateCore(admission, dispatcher, clock, seed_source, shadow=shadow)

    @maps_domain_errors
    async def Classify(self, request: gateway_pb2.ClassifyRequest, context) -> gateway_pb2.ClassifyResponse:
        caller = grpc_caller(context)
        request.request_id = request.request_id or uuid.uuid4().hex
        bind(request_id=request.request_id)
        with self._admission.scope("Classify", request.model.name, request.model.version,
                                   caller.metadata, caller.authorization) as scope:
            handler = HandlerTimes.start(scope, caller.request_start_s)
            with span("admission"):
                self._admission.admit(scope, caller.authorization, caller.timeout_s,
                                      check_request=lambda: _require_model_name(request.model.name))
                if not request.HasField("image") or request.image.WhichOneof("data") is None:
                    raise errors.InvalidArgument("image is required (encoded bytes or raw pixels)")
            admitted_s = self._clock()
            response = await self.classify_admitted(scope, request)
            done_s = self._clock()
            append_gateway_timings(response.timings, handler, admitted_s, done_s, done_s)
            scope.timings = response.timings
            return response

    async def classify_admitted(self, scope: RequestScope, request: gateway_pb2.ClassifyRequest):
        """Send an admitted classify request upstream, with retries (shared with KServe ModelInfer)."""
        upstream = scheduler_pb2.ScheduleClassifyRequest(request=request, tenant=tenant_context(scope.admitted_tenant))

        def call(client, version: str, timeout_s: float):
            upstream.request.model.version = version
            return client.classify(upstream, timeout_s)

        response = await self._dispatcher.unary(scope, WorkKind.CLASSIFY, call)
        scope.served_by(response.model.version)
        if self._shadow is not None:  # after the answer is in hand; the client never waits for it
            self._shadow.classify(scope.model, request, response, scope.tenant_id)
        return response

    @maps_domain_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        generation = self.generate_core.generate(request, grpc_caller(context))
        async for chunk in generation:
            yield chunk

    @maps_domain_errors
    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context) -> gateway_pb2.ListModelsResponse:
        return await self.list_models(grpc_authorization(context.invocation_metadata()),
                                      min(remaining_s(context) or 5.0, 5.0))

    async def list_models(self, authorization: str | None, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        """The models the caller's tenant may use, merged over every scheduler (shared with the HTTP front)."""
        tenants = self._admission.parts.tenants
        tenant = tenants.authenticate(authorization)
        endpoints = self._admission.parts.routing.endpoints()
        replies = await asyncio.gather(
            *(self._clients.get(e).list_models(timeout_s) for e in endpoints), return_exceptions=True
        )
        answered = [r for r in replies if isinstance(r, gateway_pb2.ListModelsResponse)]
        if not answered:
            failure = next(r for r in replies if isinstance(r, BaseException))
            raise failure.error if isinstance(failure, AttemptError) else failure
        merged: dict[tuple[str, str], gateway_pb2.ModelInfo] = {}
        for reply in answered:
            for info in reply.models:
                key = (info.model.name, info.model.version)
                if tenant.may_use(info.model.name) and (key not in merged or info.ready):
                    merged[key] = info
        return gateway_pb2.ListModelsResponse(models=[merged[k] for k in sorted(merged)])
