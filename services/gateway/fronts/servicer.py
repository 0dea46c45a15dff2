"""Gateway gRPC servicer (infermesh.v1.Inference): read the caller, run the call, map domain errors
to gRPC statuses (maps_domain_errors). Each RPC's life is in calls/: generate_core.py,
classify_core.py, model_list.py, shared with the HTTP fronts and KServe."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from services.common import errors
from services.common.deadlines import remaining_s
from services.common.status import maps_domain_errors
from services.gateway.calls.classify_core import ClassifyCore
from services.gateway.calls.generate_core import GenerateCore
from services.gateway.calls.model_list import ModelList
from services.gateway.calls.text_calls import TextCalls
from services.gateway.fronts.caller import grpc_caller, grpc_credentials
from services.gateway.fronts.openai_choices import grpc_choices, merged, ranked
from services.gateway.fronts.tool_calls import GrpcToolCalls, grpc_tool_choice
from services.gateway.tenants.credentials import Authorization

# ListModels waits at most this long for the schedulers, whatever the client's deadline.
_LIST_MODELS_TIMEOUT_S = 5.0
# Tokenize and Detokenize likewise (a scheduler tokenizes a long prompt in milliseconds).
_TEXT_TIMEOUT_S = 10.0


class InferenceServicer(gateway_pb2_grpc.InferenceServicer):
    def __init__(self, generate: GenerateCore, classify: ClassifyCore, models: ModelList,
                 authenticate: Callable[[Authorization], object] = lambda _: None,
                 text: TextCalls | None = None) -> None:
        """authenticate: the tenants' own check (Unauthenticated), asked only of a Generate whose n,
        best_of or tool_choice is refused before admission, so a caller without a valid key learns
        nothing about what the gateway would accept (as the OpenAI front does)."""
        self._generate = generate
        self._classify = classify
        self._models = models
        self._authenticate = authenticate
        self._text = text

    @maps_domain_errors
    async def Classify(self, request: gateway_pb2.ClassifyRequest, context) -> gateway_pb2.ClassifyResponse:
        return await self._classify.classify(request, grpc_caller(context))

    @maps_domain_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest, context):
        # A refusal (most calls under overload) is answered without an AbortError: maps_domain_errors.
        caller = grpc_caller(context)
        try:
            tools = grpc_tool_choice(request)
            plan = grpc_choices(request)
        except errors.InvalidArgument as err:
            self._authenticate(grpc_credentials(context))  # Unauthenticated first, if it is
            raise err from None
        if len(plan.requests) == 1 and tools is None:
            async for chunk in self._generate.generate(request, caller):
                yield chunk
            return
        calls = [GrpcToolCalls(tools) for _ in plan.requests] if tools is not None else None
        choices = merged(lambda r, further, admitted: self._generate.generate(r, caller, further_choice=further,
                                                                            on_admitted=admitted), plan.requests)
        async with aclosing(choices), aclosing(ranked(choices, plan) if plan.ranked else choices) as returned:
            async for index, chunk in returned:
                chunk.choice_index = index
                if calls is not None:
                    calls[index].add(chunk)
                yield chunk

    @maps_domain_errors
    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context) -> gateway_pb2.ListModelsResponse:
        return await self._models.list_models(grpc_credentials(context),
                                              min(remaining_s(context) or _LIST_MODELS_TIMEOUT_S,
                                                  _LIST_MODELS_TIMEOUT_S))

    @maps_domain_errors
    async def Tokenize(self, request: gateway_pb2.TokenizeRequest, context) -> gateway_pb2.TokenizeResponse:
        return await self._text_calls().tokenize(request, grpc_credentials(context), _text_timeout_s(context))

    @maps_domain_errors
    async def Detokenize(self, request: gateway_pb2.DetokenizeRequest, context) -> gateway_pb2.DetokenizeResponse:
        return await self._text_calls().detokenize(request, grpc_credentials(context), _text_timeout_s(context))

    def _text_calls(self) -> TextCalls:
        if self._text is None:
            raise errors.Unavailable("this gateway was built without Tokenize and Detokenize")
        return self._text


def _text_timeout_s(context) -> float:
    return min(remaining_s(context) or _TEXT_TIMEOUT_S, _TEXT_TIMEOUT_S)
