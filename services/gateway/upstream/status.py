"""Status codes of upstream (scheduler) calls, without importing grpc.

Numbers equal grpc.StatusCode values, so the servicer converts with
`UpstreamCode(rpc_error.code().value[0])`; the retry policy and the circuit
breaker reason about these.
"""

from __future__ import annotations

import enum


class UpstreamCode(enum.IntEnum):
    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16
