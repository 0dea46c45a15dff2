"""`AttemptError`: how one failed upstream call reaches the dispatcher, whichever transport carried it.

The domain error the client would see (code, message and retry hint kept as
the scheduler sent them) plus what the retry policy and the circuit breaker
need: the raw status code, the server's pushback, whether the scheduler's
handler answered. A unary RPC's failure arrives as an `AioRpcError`; a call on
the Submit stream fails with a `CallError` in a reply, or locally (deadline,
broken stream).
"""

from __future__ import annotations

import grpc

from infermesh.v1 import scheduler_pb2
from services.common import errors
from services.common.status import (
    AT_ONCE_PUSHBACK_MS,
    ERROR_BY_STATUS,
    STATUS_BY_NUMBER,
    from_rpc_error,
    pushback_ms_of,
)
from services.gateway.upstream.status import UpstreamCode


class AttemptError(Exception):
    """One upstream call failed; `error` is what the caller gets unless the gateway retries."""

    def __init__(self, error: errors.InfermeshError, code: UpstreamCode, pushback_ms: int | None,
                 *, scheduler_silent: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.code = code
        # `grpc-retry-pushback-ms` as sent (negative: do not retry); None when absent.
        self.pushback_ms = pushback_ms
        # The gateway severed the call: its scheduler stopped answering while another still answers
        # polls (routing/silence_watch.py). The call is re-dispatched while its deadline allows.
        self.scheduler_silent = scheduler_silent

    @property
    def answered_by_scheduler(self) -> bool:
        """The scheduler itself refused with a retry hint (e.g. no worker for this model).

        It is up and talking, so for its circuit breaker this is not a failure, unlike a
        connection refused or reset, which carries no hint.
        """
        return self.pushback_ms is not None

    @property
    def endpoint_gone(self) -> bool:
        """The endpoint is unreachable or leaving, rather than a live scheduler refusing this call.

        UNAVAILABLE with no retry hint is a transport failure (connection refused or
        reset, a broken Submit stream); with a pushback of "at once" it is a draining
        scheduler ("go elsewhere now"). A live scheduler's "no worker" hint waits longer.
        """
        return self.code == UpstreamCode.UNAVAILABLE and (self.pushback_ms is None or self.retry_at_once)

    @property
    def retry_at_once(self) -> bool:
        """The hint says "now" (0 in a Submit reply; 1 ms in a trailer, see status.AT_ONCE_PUSHBACK_MS)."""
        return self.pushback_ms is not None and 0 <= self.pushback_ms <= AT_ONCE_PUSHBACK_MS

    @classmethod
    def from_rpc_error(cls, exc: grpc.aio.AioRpcError) -> AttemptError:
        return cls(from_rpc_error(exc), UpstreamCode(exc.code().value[0]), pushback_ms_of(exc))

    @classmethod
    def from_call_error(cls, error: scheduler_pb2.CallError) -> AttemptError:
        """The same AttemptError `from_rpc_error` makes of the unary RPC's status."""
        status = STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN)
        pushback_ms = error.retry_pushback_ms if error.HasField("retry_pushback_ms") else None
        kind = errors.Internal if status == grpc.StatusCode.UNKNOWN else ERROR_BY_STATUS.get(status, errors.Internal)
        message = error.message or status.name
        domain: errors.InfermeshError
        if issubclass(kind, errors.ResourceExhausted | errors.Unavailable):
            retry_after_s = None if pushback_ms is None else max(0.0, pushback_ms / 1000)
            domain = kind(message, retry_after_s=retry_after_s)
        else:
            domain = kind(message)
        return cls(domain, UpstreamCode(status.value[0]), pushback_ms)

    @classmethod
    def local(cls, code: UpstreamCode, message: str, *, scheduler_silent: bool = False) -> AttemptError:
        """A failure the gateway decided itself (deadline passed, stream broke): no pushback."""
        status = STATUS_BY_NUMBER[code.value]
        return cls(ERROR_BY_STATUS.get(status, errors.Internal)(message), code, None,
                   scheduler_silent=scheduler_silent)

