"""ListModels, whatever the transport (gRPC ListModels, OpenAI GET /v1/models): the models the
caller's tenant may use, merged over every scheduler the routing table knows."""

from __future__ import annotations

import asyncio

from infermesh.v1 import gateway_pb2
from services.gateway.admission.admission import Admission
from services.gateway.tenants.credentials import Authorization
from services.gateway.upstream.clients import AttemptError, SchedulerClients


class ModelList:
    def __init__(self, admission: Admission, clients: SchedulerClients) -> None:
        self._admission = admission
        self._clients = clients

    async def list_models(self, authorization: Authorization, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        """The models the caller's tenant may use, merged over every scheduler; a version any of
        them reports ready counts as ready. Fails only when no scheduler answered."""
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
