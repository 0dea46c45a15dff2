"""Gateway gRPC servicer (infermesh.v1.Inference): validate, admit, set the deadline, forward."""

from __future__ import annotations

import time
import uuid

from opentelemetry import trace

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2
from services.common import errors
from services.common.status import maps_domain_errors
from services.common.telemetry import context_from_metadata, tracer
from services.common.timings import StageTime, seconds_to_us
from services.gateway.config import GatewayConfig
from services.gateway.upstream import SchedulerClient

_tracer = tracer("infermesh.gateway")
SERVICE = "gateway"
ANONYMOUS = scheduler_pb2.TenantContext(tenant_id="anonymous", priority=common_pb2.PRIORITY_STANDARD, weight=1)


def _append_gateway_timings(timings: common_pb2.Timings, admission_s: float, total_s: float) -> None:
    for stage in (StageTime("admission", seconds_to_us(admission_s), SERVICE),
                  StageTime("gateway", seconds_to_us(total_s), SERVICE)):
        timings.stages.add(stage=common_pb2.Stage.Value("STAGE_" + stage.stage.upper()),
                           duration_us=stage.duration_us, service=SERVICE)
    timings.total_us = seconds_to_us(total_s)


class InferenceServicer(gateway_pb2_grpc.InferenceServicer):
    def __init__(self, config: GatewayConfig, scheduler: SchedulerClient, clock=time.monotonic) -> None:
        self._config = config
        self._scheduler = scheduler
        self._clock = clock

    def _timeout_s(self, context) -> float:
        """What the scheduler gets: the client's remaining time (default/clamped) minus our margin."""
        remaining_s = context.time_remaining()
        if remaining_s is None or remaining_s > 1e6:
            remaining_s = self._config.default_deadline_ms / 1000
        remaining_s = min(remaining_s, self._config.max_deadline_ms / 1000)
        timeout_s = remaining_s - self._config.hop_margin_ms / 1000
        if timeout_s <= 0:
            raise errors.DeadlineExceeded(f"only {remaining_s * 1000:.1f} ms left; nothing can finish in time")
        return timeout_s

    @maps_domain_errors
    async def Classify(self, request: gateway_pb2.ClassifyRequest, context) -> gateway_pb2.ClassifyResponse:
        began_s = self._clock()
        parent = context_from_metadata(context.invocation_metadata())
        with _tracer.start_as_current_span("gateway.Classify", context=parent, kind=trace.SpanKind.SERVER):
            with _tracer.start_as_current_span("admission"):
                if not request.model.name:
                    raise errors.InvalidArgument("model.name is required")
                if not request.HasField("image") or request.image.WhichOneof("data") is None:
                    raise errors.InvalidArgument("image is required (encoded bytes or raw pixels)")
                request.request_id = request.request_id or uuid.uuid4().hex
                timeout_s = self._timeout_s(context)
            admitted_s = self._clock()
            upstream = scheduler_pb2.ScheduleClassifyRequest(request=request, tenant=ANONYMOUS)
            response = await self._scheduler.classify(upstream, timeout_s)
            _append_gateway_timings(response.timings, admitted_s - began_s, self._clock() - began_s)
            return response

    @maps_domain_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        began_s = self._clock()
        parent = context_from_metadata(context.invocation_metadata())
        with _tracer.start_as_current_span("gateway.Generate", context=parent, kind=trace.SpanKind.SERVER):
            with _tracer.start_as_current_span("admission"):
                if not request.model.name:
                    raise errors.InvalidArgument("model.name is required")
                if not request.prompt:
                    raise errors.InvalidArgument("prompt must not be empty")
                request.request_id = request.request_id or uuid.uuid4().hex
                timeout_s = self._timeout_s(context)
            admitted_s = self._clock()
            upstream = scheduler_pb2.ScheduleGenerateRequest(request=request, tenant=ANONYMOUS)
            async for chunk in self._scheduler.generate(upstream, timeout_s):
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    _append_gateway_timings(chunk.timings, admitted_s - began_s, self._clock() - began_s)
                yield chunk

    @maps_domain_errors
    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context) -> gateway_pb2.ListModelsResponse:
        return await self._scheduler.list_models(timeout_s=self._timeout_s(context))
