"""One Classify call's life, whatever the transport: admit, dispatch with retries, account.

The gRPC Classify (fronts/servicer.py) runs `classify`; KServe ModelInfer (kserve/core.py) admits
its own way and runs `classify_admitted`. A shadow step mirrors the answered request
(rollout/shadow.py) after the client has its answer.
"""

from __future__ import annotations

import time
import uuid

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.common import errors
from services.common.log_context import bind
from services.gateway.admission.admission import Admission, RequestScope
from services.gateway.calls.generate_core import Caller, HandlerTimes, append_gateway_timings, tenant_context
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.retry_policy import WorkKind
from services.gateway.rollout.shadow import ShadowMirror
from services.gateway.telemetry.tracing import span


def _require_model_name(name: str) -> None:
    if not name:
        raise errors.InvalidArgument("model.name is required")


class ClassifyCore:
    def __init__(self, admission: Admission, dispatcher: Dispatcher, clock=time.monotonic,
                 shadow: ShadowMirror | None = None) -> None:
        """shadow: mirrors answered version-less requests at a rollout's shadow step (shadow.py)."""
        self._admission = admission
        self._dispatcher = dispatcher
        self._clock = clock
        self._shadow = shadow

    async def classify(self, request: gateway_pb2.ClassifyRequest, caller: Caller) -> gateway_pb2.ClassifyResponse:
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
