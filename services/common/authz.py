"""The per-method identity check as a grpc.aio server interceptor.

An aio interceptor sees only the method name and metadata, not the peer's certificate,
so it wraps the method's handler: the wrapper reads the verified auth context from the
servicer context before the first message is handled, and aborts with PERMISSION_DENIED
when `identity.IdentityPolicy` says no. grpc.aio picks the calling convention by the
handler's kind (coroutine function: reader/writer API or unary; async generator
function: streamed responses), so the wrapper keeps the kind of what it wraps.
Streams pay one extra async-generator hop per response message, only with the check on.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

import grpc

from services.common.handler_wrapping import FACTORIES, HandlerWrappingInterceptor
from services.common.identity import IdentityPolicy, peer_identity

log = logging.getLogger(__name__)


class IdentityInterceptor(HandlerWrappingInterceptor):
    """Refuses every call whose verified peer identity the policy does not allow for the method."""

    def __init__(self, policy: IdentityPolicy) -> None:
        super().__init__()
        self._policy = policy

    def wrap(self, handler: grpc.RpcMethodHandler, kind: str, method: str) -> grpc.RpcMethodHandler:
        return FACTORIES[kind](
            _guard(getattr(handler, kind), method, self._policy),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


async def _check(context: grpc.aio.ServicerContext, method: str, policy: IdentityPolicy) -> None:
    peer = peer_identity(context.auth_context())
    decision = policy.decide(method, peer)
    if not decision.allowed:
        log.warning("refused %s from %s: %s", method, context.peer(), decision.reason)
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, decision.reason)


def _guard(behavior: Callable, method: str, policy: IdentityPolicy) -> Callable:
    if inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request, context):
            await _check(context, method, policy)
            async for response in behavior(request, context):
                yield response

        return guarded_stream

    if inspect.isgeneratorfunction(behavior):
        async def guarded_sync_stream(request, context):
            await _check(context, method, policy)
            for response in behavior(request, context):
                yield response

        return guarded_sync_stream

    async def guarded(request, context):
        await _check(context, method, policy)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return guarded
