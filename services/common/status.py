"""The one table between domain errors and gRPC status codes, both directions.

Servicers wrap handlers with `maps_domain_errors`; clients turn an upstream
`AioRpcError` back into a domain error with `from_rpc_error`, so a status passes
through the gateway unchanged (code, message and retry hint).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from services.common import errors

log = logging.getLogger(__name__)

PUSHBACK_KEY = "grpc-retry-pushback-ms"
# "Retry at once" goes on the wire as 1 ms, never 0: a stock grpcio client (1.85) whose service
# config has a retryPolicy does not retry on a pushback of "0" but waits for its deadline
# (tests/integration/test_pushback_with_grpc_retries.py). Readers take <= this as "at once".
AT_ONCE_PUSHBACK_MS = 1
_DETAILS_KEY = "grpc-status-details-bin"
# A status message travels in the trailers, which a stock client caps (grpc-python: 16 KiB, hard):
# an error that echoed a 17 000-character model name reached the caller as RESOURCE_EXHAUSTED
# "received metadata size exceeds hard limit" instead of its own code. Longer messages are cut.
MAX_MESSAGE_CHARS = 1024

STATUS_BY_ERROR: dict[type[errors.InfermeshError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.Internal: grpc.StatusCode.INTERNAL,
}
ERROR_BY_STATUS = {code: cls for cls, code in STATUS_BY_ERROR.items()}


def status_code_of(err: errors.InfermeshError) -> grpc.StatusCode:
    for cls in type(err).__mro__:
        if cls in STATUS_BY_ERROR:
            return STATUS_BY_ERROR[cls]
    return grpc.StatusCode.INTERNAL


def wire_message(message: str) -> str:
    """`message` as it may travel in a status: cut to MAX_MESSAGE_CHARS, saying how much was cut."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"


def trailing_metadata_of(err: errors.InfermeshError) -> tuple[tuple[str, str | bytes], ...]:
    """Retry hint as both `grpc-retry-pushback-ms` and google.rpc.RetryInfo details."""
    retry_after_s = getattr(err, "retry_after_s", None)
    if retry_after_s is None:
        return ()
    code = status_code_of(err)
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(int(retry_after_s * 1000))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    rich = status_pb2.Status(code=code.value[0], message=wire_message(err.message), details=[detail])
    return (
        (PUSHBACK_KEY, str(max(AT_ONCE_PUSHBACK_MS, int(retry_after_s * 1000)))),
        (_DETAILS_KEY, rich.SerializeToString()),
    )


async def abort(context: grpc.aio.ServicerContext, err: errors.InfermeshError) -> None:
    await context.abort(status_code_of(err), wire_message(err.message), trailing_metadata=trailing_metadata_of(err))


def set_error_status(context: grpc.aio.ServicerContext, err: errors.InfermeshError) -> None:
    """The same status as abort(), for a unary handler that then returns (grpc.aio sends the status
    and drops the reply). No AbortError is raised: its traceback holds the handler's frames, which
    hold the call's state, which holds the AbortError, so every aborted call left a reference cycle
    for the garbage collector (~50 objects); at ~1000 refusals/s those made gen-2 collections of
    35-40 ms every ~2 s in the scheduler (docs/scheduler.md, "Fairness and the standing queue")."""
    context.set_code(status_code_of(err))
    context.set_details(wire_message(err.message))
    trailing = trailing_metadata_of(err)
    if trailing:
        context.set_trailing_metadata(trailing)


def pushback_ms_of(rpc_error: grpc.RpcError) -> int | None:
    """The status's `grpc-retry-pushback-ms` as sent (negative: the server says "do not retry");
    None when absent or not an integer."""
    for key, value in rpc_error.trailing_metadata() or ():
        if key == PUSHBACK_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def retry_after_s_of(rpc_error: grpc.RpcError) -> float | None:
    pushback_ms = pushback_ms_of(rpc_error)
    return None if pushback_ms is None else max(0.0, pushback_ms / 1000)


def from_rpc_error(rpc_error: grpc.RpcError) -> errors.InfermeshError:
    """The domain error an upstream status stands for, keeping message and hint."""
    code = rpc_error.code()
    message = rpc_error.details() or code.name
    cls = ERROR_BY_STATUS.get(code, errors.Internal)
    if code == grpc.StatusCode.UNKNOWN:
        cls = errors.Internal
    if issubclass(cls, errors._RetryableError):
        return cls(message, retry_after_s=retry_after_s_of(rpc_error))
    return cls(message)


def maps_domain_errors(handler: Callable) -> Callable:
    """Turn domain errors raised by a servicer method into statuses.

    Unexpected exceptions become INTERNAL with the traceback logged, never a
    crashed process or an OK with an error string.
    """

    async def _handle(context, exc: BaseException) -> None:
        if isinstance(exc, errors.InfermeshError):
            # Set and returned, not aborted: most domain errors are refusals, and an AbortError's
            # traceback left each call's frames in a reference cycle (set_error_status).
            set_error_status(context, exc)
            return
        log.exception("unhandled error in %s", handler.__qualname__)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream_wrapper(self, request, context):
            try:
                async for item in handler(self, request, context):
                    yield item
            except (errors.InfermeshError, ValueError, KeyError, TypeError, RuntimeError) as exc:
                await _handle(context, exc)

        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except (errors.InfermeshError, ValueError, KeyError, TypeError, RuntimeError) as exc:
            await _handle(context, exc)

    return unary_wrapper


# google.rpc.Code numbers equal grpc.StatusCode values; workers report item errors by number.
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
