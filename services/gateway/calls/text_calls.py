"""Tokenize, Detokenize and the tokenizer's configuration, whatever the transport (gRPC, vLLM's POST
/tokenize and /detokenize, GET /tokenizer_info): a
generator's tokenizer lives with its schedulers (they tokenize each request once, for the prefix
cache and routing), so the gateway asks one that serves the model, trying the next when one cannot
answer. Authenticated and limited to the tenant's models like Generate; nothing is queued, generated
or counted against quotas, so no admission. A request that names no model means the caller's only
generator, as vLLM's single model (lm-evaluation-harness's remote tokenizer names none)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from google.protobuf.message import Message

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.admission.admission import Admission
from services.gateway.tenants.credentials import Authorization
from services.gateway.tenants.directory import Tenant
from services.gateway.upstream.clients import AttemptError, SchedulerClient, SchedulerClients
from services.gateway.upstream.status import UpstreamCode

Reply = TypeVar("Reply", bound=Message)
# A scheduler that cannot answer for the model (gone, draining, no longer serving it): ask the next.
_NEXT_SCHEDULER = frozenset({UpstreamCode.UNAVAILABLE, UpstreamCode.NOT_FOUND, UpstreamCode.DEADLINE_EXCEEDED})


class TextCalls:
    def __init__(self, admission: Admission, clients: SchedulerClients,
                 generators: Callable[[], Iterable[str]] = tuple) -> None:
        """generators: the names of the generator models the schedulers report (ModelCatalog)."""
        self._admission = admission
        self._clients = clients
        self._generators = generators

    async def tokenize(self, request: gateway_pb2.TokenizeRequest, authorization: Authorization,
                       timeout_s: float) -> gateway_pb2.TokenizeResponse:
        return await self._ask(request, authorization, timeout_s, lambda client, r, t: client.tokenize(r, t))

    async def detokenize(self, request: gateway_pb2.DetokenizeRequest, authorization: Authorization,
                         timeout_s: float) -> gateway_pb2.DetokenizeResponse:
        return await self._ask(request, authorization, timeout_s, lambda client, r, t: client.detokenize(r, t))

    async def tokenizer_info(self, request: gateway_pb2.GetTokenizerInfoRequest, authorization: Authorization,
                             timeout_s: float) -> gateway_pb2.GetTokenizerInfoResponse:
        return await self._ask(request, authorization, timeout_s, lambda client, r, t: client.tokenizer_info(r, t))

    async def _ask(self, request: gateway_pb2.TokenizeRequest | gateway_pb2.DetokenizeRequest
                   | gateway_pb2.GetTokenizerInfoRequest,
                   authorization: Authorization, timeout_s: float,
                   call: Callable[[SchedulerClient, Any, float], Awaitable[Reply]]) -> Reply:
        parts = self._admission.parts
        tenant = parts.tenants.authenticate(authorization)
        model = common_pb2.ModelRef(name=request.model.name or self._only_generator(tenant),
                                    version=request.model.version)
        parts.tenants.check_model_allowed(tenant, model.name)
        candidates = parts.routing.candidates(model.name, model.version)  # NotFound for an unknown model
        upstream = type(request)()
        upstream.CopyFrom(request)
        upstream.model.name = model.name
        upstream.model.version = model.version or candidates.route.version  # the version Generate would use
        failure: errors.InfermeshError | None = None
        for endpoint in candidates.untried:
            try:
                return await call(self._clients.get(endpoint.address), upstream, timeout_s)
            except AttemptError as err:
                if err.code is UpstreamCode.UNIMPLEMENTED:  # mid-roll: a scheduler older than this gateway
                    failure = errors.Unavailable(
                        f"scheduler {endpoint.address} is older than this gateway and does not answer this "
                        "(UNIMPLEMENTED); it will once the schedulers are upgraded")
                    continue
                if err.code not in _NEXT_SCHEDULER:
                    raise err.error from None
                failure = err.error
        if failure is not None:
            raise failure
        raise errors.Unavailable(f"no scheduler serving model '{model.name}' can be reached now")

    def _only_generator(self, tenant: Tenant) -> str:
        names = sorted({name for name in self._generators() if tenant.may_use(name)})
        if len(names) != 1:
            served = f"{len(names)} generators ({', '.join(names)})" if names else "no generator"
            raise errors.InvalidArgument(f"model.name is required: this gateway serves {served} to this caller")
        return names[0]
