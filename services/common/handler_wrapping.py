"""A server interceptor that wraps each method's handler once and reuses the wrapped twin.

grpc.aio interceptors see neither the request nor the peer certificate, only the handler about
to run; the way to act on either is to hand gRPC a replacement handler. Building one per call
would cost a closure and a handler object every call, so each method's twin is made on its first
call and kept (one entry per served method). Subclasses say how one handler's behavior is wrapped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

# The four kinds of method handler, and the factory that builds each.
BEHAVIORS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class HandlerWrappingInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # Method -> (the handler as registered, its wrapped twin).
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def wrap(self, handler: grpc.RpcMethodHandler, kind: str, method: str) -> grpc.RpcMethodHandler:
        """The twin of `handler` (its behavior is `getattr(handler, kind)`) for `method`."""
        raise NotImplementedError

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: gRPC answers UNIMPLEMENTED itself
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        kind = next(k for k in BEHAVIORS if getattr(handler, k) is not None)
        wrapped = self.wrap(handler, kind, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped
