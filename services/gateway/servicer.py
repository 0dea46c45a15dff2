"""Gateway gRPC servicer (infermesh.v1.Inference): validate, admit, dispatch with retries, account."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from services.common import errors
from services.common.log_context import bind
from services.common.status import maps_domain_errors
from services.common.stream_options import stream_options
from services.gateway.admission import Admission, RequestScope, span
from services.gateway.dispatch import Dispatcher
from services.gateway.retry_policy import WorkKind
from services.gateway.stage_timings import REQUEST_START_KEY, gateway_stages, ingress_s, parse_request_start_s
from services.gateway.tenants import Tenant
from services.gateway.upstream import AttemptError, SchedulerClients

SERVICE = "gateway"
# The scheduler's max_tokens when the client sets none (services/scheduler/servicer.py); the quota
# charge assumes it, and the unused part is refunded at the end.
DEFAULT_MAX_TOKENS = 128


def authorization_of(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return None


@dataclass(frozen=True)
class CallerMetadata:
    authorization: str | None
    # The client's send time (x-request-start), unix seconds; None when it sent none.
    request_start_s: float | None

    @classmethod
    def read(cls, metadata) -> CallerMetadata:
        """One pass over the metadata: it runs for every request, refused ones included."""
        authorization = request_start = None
        for key, value in metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode("utf-8", "replace")
            elif key == REQUEST_START_KEY:
                request_start = value
        return cls(authorization, parse_request_start_s(request_start))


def client_timeout_s(context) -> float | None:
    """The client's remaining time; None when it set no deadline."""
    remaining_s = context.time_remaining()
    if remaining_s is None or remaining_s > 1e6:
        return None
    return remaining_s


def prompt_tokens_upper_bound(prompt: str) -> int:
    # Schedulers tokenize bytes (plus a BOS token); every tokenizer spends at least one byte per
    # token, so this never undercharges. The exact count comes back in the last chunk's usage.
    return len(prompt.encode("utf-8")) + 1


def tenant_context(tenant: Tenant) -> scheduler_pb2.TenantContext:
    return scheduler_pb2.TenantContext(tenant_id=tenant.tenant_id, priority=int(tenant.priority), weight=tenant.weight)


def fix_seed(sampling: common_pb2.SamplingParams, seed_source: Callable[[], int]) -> None:
    """Sets a seed (< 2**63) on a sampled request that has none, before its first attempt.

    Sampling is a function of (seed, position), so with the seed fixed here a stream
    resumed on another scheduler samples exactly what the unbroken one would have.
    Greedy requests need none.
    """
    if sampling.temperature > 0 and not sampling.HasField("seed"):
        sampling.seed = seed_source()


@dataclass(frozen=True)
class HandlerTimes:
    """When one request's handler ran, on the gateway's monotonic clock (and the wall clock for ingress)."""

    began_s: float
    began_unix_s: float
    request_start_s: float | None

    @classmethod
    def start(cls, scope: RequestScope, caller: CallerMetadata) -> HandlerTimes:
        return cls(scope.began_s, time.time(), caller.request_start_s)


def append_gateway_timings(timings: common_pb2.Timings, handler: HandlerTimes, admitted_s: float,
                           upstream_done_s: float | None, now_s: float) -> None:
    """Adds the gateway's stages to the upstream's (whose total_us is the scheduler's) and sets the total."""
    stages = gateway_stages(
        ingress_s=ingress_s(handler.request_start_s, handler.began_unix_s),
        admission_s=admitted_s - handler.began_s,
        upstream_s=None if upstream_done_s is None else upstream_done_s - admitted_s,
        upstream_total_us=timings.total_us,
        total_s=now_s - handler.began_s,
    )
    add = timings.stages.add
    for stage in stages:
        add(stage=_STAGE_VALUES[stage.stage], duration_us=stage.duration_us, service=SERVICE)
    timings.total_us = stages[-1].duration_us


_STAGE_VALUES = {name.removeprefix("STAGE_").lower(): value for name, value in common_pb2.Stage.items()}


class InferenceServicer(gateway_pb2_grpc.InferenceServicer):
    def __init__(
        self, admission: Admission, dispatcher: Dispatcher, clients: SchedulerClients, clock=time.monotonic,
        seed_source: Callable[[], int] = lambda: secrets.randbits(63),
    ) -> None:
        self._admission = admission
        self._dispatcher = dispatcher
        self._clients = clients
        self._clock = clock
        self._seed_source = seed_source

    @maps_domain_errors
    async def Classify(self, request: gateway_pb2.ClassifyRequest, context) -> gateway_pb2.ClassifyResponse:
        metadata = context.invocation_metadata()
        caller = CallerMetadata.read(metadata)
        request.request_id = request.request_id or uuid.uuid4().hex
        bind(request_id=request.request_id)
        with self._admission.scope("Classify", request.model.name, request.model.version,
                                   metadata, caller.authorization) as scope:
            handler = HandlerTimes.start(scope, caller)
            with span("admission"):
                if not request.model.name:
                    raise errors.InvalidArgument("model.name is required")
                self._admission.admit(scope, caller.authorization, client_timeout_s(context))
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
        upstream = scheduler_pb2.ScheduleClassifyRequest(request=request, tenant=tenant_context(scope.tenant))

        def call(client, version: str, timeout_s: float):
            upstream.request.model.version = version
            return client.classify(upstream, timeout_s)

        response = await self._dispatcher.unary(scope, WorkKind.CLASSIFY, call)
        scope.served_by(response.model.version)
        return response

    @maps_domain_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        metadata = context.invocation_metadata()
        caller = CallerMetadata.read(metadata)
        request.request_id = request.request_id or uuid.uuid4().hex
        bind(request_id=request.request_id)
        with self._admission.scope("Generate", request.model.name, request.model.version,
                                   metadata, caller.authorization) as scope:
            handler = HandlerTimes.start(scope, caller)
            with span("admission"):
                if not request.model.name:
                    raise errors.InvalidArgument("model.name is required")
                if not request.prompt:
                    raise errors.InvalidArgument("prompt must not be empty")
                # Refused here with the scheduler's own check: coalescing itself happens upstream.
                stream_options(request.stream.max_tokens_per_chunk, request.stream.interval_ms)
                prompt_tokens = prompt_tokens_upper_bound(request.prompt)
                num_tokens = prompt_tokens + (request.sampling.max_tokens or DEFAULT_MAX_TOKENS)
                self._admission.admit(scope, caller.authorization, client_timeout_s(context), num_tokens)
                fix_seed(request.sampling, self._seed_source)
            admitted_s = self._clock()
            upstream = scheduler_pb2.ScheduleGenerateRequest(request=request, tenant=tenant_context(scope.tenant))

            def call(client, version: str, timeout_s: float, continuation: tuple[int, ...]):
                upstream.request.model.version = version
                if continuation:
                    upstream.continuation.token_ids[:] = continuation
                return client.generate(upstream, timeout_s)

            num_generated = 0
            # Until the last chunk says what was used: the prompt once generation started, plus tokens sent.
            scope.num_tokens_used = 0

            def on_chunk(chunk: gateway_pb2.GenerateResponse) -> None:
                nonlocal num_generated
                if num_generated == 0 and scope.model_permit is not None:
                    scope.model_permit.first_response()
                num_generated += len(chunk.token_ids)
                scope.served_by(chunk.model.version)  # set on the first and the last chunk
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    scope.num_tokens_used = chunk.usage.prompt_tokens + chunk.usage.completion_tokens
                    now_s = self._clock()
                    append_gateway_timings(chunk.timings, handler, admitted_s, now_s, now_s)
                    scope.timings = chunk.timings
                else:
                    scope.num_tokens_used = prompt_tokens + num_generated

            async for chunk in self._dispatcher.stream(scope, call, on_chunk):
                yield chunk

    @maps_domain_errors
    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context) -> gateway_pb2.ListModelsResponse:
        tenants = self._admission.parts.tenants
        tenant = tenants.authenticate(authorization_of(context.invocation_metadata()))
        timeout_s = min(client_timeout_s(context) or 5.0, 5.0)
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
