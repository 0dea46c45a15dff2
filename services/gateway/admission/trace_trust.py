"""Whose W3C trace context the gateway follows (--trust-trace-context, docs/security.md).

none     every caller is untrusted: each request starts a trace the gateway's sampler decides, and
         the traceparent the client sent becomes a span link (the default);
all      every caller's context is followed (a trusted proxy in front sets it);
tenants  followed for tenants marked `trust_trace_context: true` in the tenants file, linked for the rest.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.common.errors import InfermeshError
from services.common.telemetry import context_from_metadata, edge_parent
from services.gateway.tenants.credentials import Authorization
from services.gateway.tenants.directory import Tenant


class TrustMode(enum.Enum):
    NONE = "none"
    ALL = "all"
    TENANTS = "tenants"


class Authenticator(Protocol):
    def authenticate(self, authorization: Authorization) -> Tenant: ...


class TraceTrust:
    def __init__(self, mode: TrustMode = TrustMode.NONE, tenants: Authenticator | None = None) -> None:
        if mode is TrustMode.TENANTS and tenants is None:
            raise ValueError("trust mode 'tenants' needs the tenants to authenticate callers with")
        self.mode = mode
        self._tenants = tenants

    def trusts(self, authorization: Authorization) -> bool:
        if self.mode is TrustMode.NONE:
            return False
        if self.mode is TrustMode.ALL:
            return True
        try:
            # The same lookup admission makes next; a caller it refuses is simply not trusted here.
            assert self._tenants is not None  # TENANTS mode requires them (__init__)
            return self._tenants.authenticate(authorization).trust_trace_context
        except InfermeshError:
            return False

    def parent(self, metadata: Iterable[tuple[str, str | bytes]] | None,
               authorization: Authorization) -> tuple[otel_context.Context, tuple[trace.Link, ...]]:
        """The request's server span's parent and links (telemetry.edge_parent)."""
        caller = context_from_metadata(metadata)
        sent = trace.get_current_span(caller).get_span_context().is_valid
        # Asked only when the caller sent a context: in tenants mode that costs a second key hash.
        return edge_parent(caller, sent and self.trusts(authorization))
