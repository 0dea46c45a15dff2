"""Undecodable request messages answer INVALID_ARGUMENT, as a grpc.aio server interceptor.

grpc.aio parses a request with the handler's deserializer outside the servicer, and a
protobuf DecodeError there (truncated or corrupt wire bytes, a string field that is not
UTF-8) surfaces as UNKNOWN "Unexpected <class 'DecodeError'>". The caller sent a bad
message, so it is INVALID_ARGUMENT. This interceptor swaps each handler's deserializer
for one that returns an `Undecodable` marker instead of raising, and wraps the behavior:

    unary request:  the marker aborts before the servicer runs;
    stream request: `context.read()` and the request iterator abort when they meet it.

The wrapper keeps the kind of what it wraps (coroutine, async generator) since grpc.aio
picks the calling convention by it; a streamed response pays one async-generator hop
per message.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from services.common.handler_wrapping import FACTORIES, HandlerWrappingInterceptor


@dataclass(frozen=True)
class Undecodable:
    """What the deserializer hands on instead of raising: why the bytes did not parse."""

    reason: str


def tolerant(deserializer: Callable[[bytes], object] | None, method: str) -> Callable[[bytes], object]:
    """A deserializer that returns Undecodable for bytes `deserializer` refuses."""
    def decode(raw: bytes) -> object:
        if deserializer is None:
            return raw
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever a custom deserializer raises
            return Undecodable(f"{method}: the request is not a valid message ({exc})")

    return decode


async def abort_undecodable(context: grpc.aio.ServicerContext, message: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.reason)


class DecodedContext:
    """The servicer context with `read()` aborting on an Undecodable message; all else delegated."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    async def read(self):
        message = await self._context.read()
        if isinstance(message, Undecodable):
            await abort_undecodable(self._context, message)
        return message

    async def read_marked(self):
        """The next message, or the Undecodable marker itself (no abort).

        For a handler that reads in a task of its own: an abort from there can run while the
        handler's task is sending a message, and when grpc refuses the second send the status
        is never sent, so the client waits out its deadline. Such a handler aborts from its own
        task once it has stopped writing.
        """
        return await self._context.read()

    def __getattr__(self, name: str):
        return getattr(self._context, name)


async def decoded_requests(requests: AsyncIterator, context: grpc.aio.ServicerContext) -> AsyncIterator:
    async for message in requests:
        if isinstance(message, Undecodable):
            await abort_undecodable(context, message)
        yield message


class RequestDecodingInterceptor(HandlerWrappingInterceptor):
    """Answers INVALID_ARGUMENT for request bytes the method's message type cannot parse. Counts the
    calls grpc.aio hands it (`num_handed`: every one that passed the identity check, unknown methods
    too), which a drain watches to know grpc core's queue is empty (call_backlog.py): counted here, in
    the interceptor every server has, not in one of its own (one more interceptor costs a unary call
    ~40 us of CPU on a 2-core box)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_handed = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        self.num_handed += 1
        return await super().intercept_service(continuation, handler_call_details)

    def wrap(self, handler: grpc.RpcMethodHandler, kind: str, method: str) -> grpc.RpcMethodHandler:
        wrap = _wrap_stream_request if handler.request_streaming else _wrap_unary_request
        return FACTORIES[kind](
            wrap(getattr(handler, kind)),
            request_deserializer=tolerant(handler.request_deserializer, method),
            response_serializer=handler.response_serializer,
        )


def _wrap_unary_request(behavior: Callable) -> Callable:
    if inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior):
        is_async = inspect.isasyncgenfunction(behavior)

        async def streamed(request, context):
            if isinstance(request, Undecodable):
                await abort_undecodable(context, request)
            if is_async:
                async for response in behavior(request, context):
                    yield response
            else:
                for response in behavior(request, context):
                    yield response

        return streamed

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await abort_undecodable(context, request)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary


def _wrap_stream_request(behavior: Callable) -> Callable:
    if inspect.isasyncgenfunction(behavior):
        async def streamed(requests, context):
            async for response in behavior(decoded_requests(requests, context), DecodedContext(context)):
                yield response

        return streamed

    if inspect.isgeneratorfunction(behavior):
        raise TypeError("a synchronous generator cannot serve a request stream on grpc.aio")

    async def unary(requests, context):
        result = behavior(decoded_requests(requests, context), DecodedContext(context))
        return await result if inspect.isawaitable(result) else result

    return unary
