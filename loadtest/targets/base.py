"""The seam every target kind implements, and what the kinds share: request headers, status names.

A target turns a PlannedRequest into its wire protocol and the reply into an Outcome; the runner,
the measurement (from the scheduled send time) and the report are the same for every kind.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from loadtest.records import Outcome
from loadtest.workload import PlannedRequest


class TargetError(Exception):
    """The target did not answer a readiness probe (unreachable, refused, malformed)."""


class Target(Protocol):
    """Stages are per reply (Outcome.stages): a report marks stage columns absent when no reply had any."""

    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome: ...

    async def ready_models(self, models: Iterable[str], api_key: str, timeout_s: float) -> set[str]:
        """Which of `models` the target serves and reports ready; raises TargetError when it cannot tell."""
        ...

    async def close(self) -> None: ...


def request_start_value() -> str:
    """`x-request-start` (the send time, unix microseconds): our gateway reports the wait before its
    handler ran as the `ingress` stage; other servers ignore it."""
    return f"t={time.time_ns() // 1000}"


def http_status_name(status: int) -> str:
    """The report's status for an HTTP error reply: the code itself, not a guessed gRPC equivalent."""
    return f"HTTP_{status}"


@dataclass(frozen=True)
class TraceContext:
    trace_id: str  # 32 hex digits
    traceparent: str  # W3C: 00-<trace id>-<parent span id>-01 (sampled, so a trusting server records it)


class TraceIds:
    """One trace per request: a random prefix per target, then the request's number, so ids are
    unique across runs and cost no random draw on the send path."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)

    def for_request(self, seq: int) -> TraceContext:
        trace_id = f"{self._prefix}{seq & 0xFFFF_FFFF_FFFF_FFFF:016x}"
        return TraceContext(trace_id, f"00-{trace_id}-{(seq + 1) & 0xFFFF_FFFF_FFFF_FFFF or 1:016x}-01")
