"""Domain errors. Logic modules raise these; `status.py` maps them to gRPC codes.

Each class names the one gRPC status it becomes, so the mapping table stays a
single place and domain code never imports grpc.
"""

from __future__ import annotations


class InfermeshError(Exception):
    """Base of every error that reaches a caller as a non-OK status."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(InfermeshError):
    """The request itself is wrong; retrying it unchanged cannot succeed."""


class NotFound(InfermeshError):
    """The named model or version does not exist."""


class Unauthenticated(InfermeshError):
    """No API key, or one that matches no tenant."""


class PermissionDenied(InfermeshError):
    """The tenant is known but may not use this model."""


class FailedPrecondition(InfermeshError):
    """The system is not in a state that allows the request (e.g. a rollout follower asked to decide)."""


class DeadlineExceeded(InfermeshError):
    """The deadline passed, or cannot be met, so no work is spent on it."""


class _RetryableError(InfermeshError):
    """An error the caller may retry after `retry_after_s` (None: no hint)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        if retry_after_s is not None and retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.retry_after_s = retry_after_s


class ResourceExhausted(_RetryableError):
    """Over quota, queue full or shed under overload."""


class Unavailable(_RetryableError):
    """No capacity right now (no worker, upstream down); no work was done."""


class Cancelled(InfermeshError):
    """The caller went away; the work was abandoned."""


class Internal(InfermeshError):
    """A bug or broken invariant; the message is safe to show."""
