"""Who is calling, read once per request from the transport: a `Caller` (calls/generate_core.py).

One home for what every front reads off the wire before any policy runs: the authorization
value, the client's send time (x-request-start), its deadline, the x-infermesh-priority value
and the trace-context pairs. gRPC fronts (servicer.py, kserve_servicer.py, the admin status)
read invocation metadata; HTTP fronts (openai_http.py, kserve_http.py) read headers, with the
deadline in x-infermesh-timeout-ms.

Authorization sent several times is joined as HTTP joins repeated fields ("a, b") on both
transports, and the tenants' one check (tenants/directory.py, `TenantDirectory.recognize`)
refuses a value that holds more than one key, whatever their order: a second value must never
silently win over the first.

A connection that came with a verified client certificate (--tls-client-auth optional or
require) adds the certificate's SAN names: the authorization value then travels as
`Credentials` (tenants/credentials.py), and the tenants' check matches the names against the
tenants file. gRPC hands them over per call (`peer_identities`, a fraction of a microsecond;
`auth_context()` would copy the whole PEM, hundreds of microseconds); HTTP keeps the peer
certificate the handshake verified on the transport.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.common import errors
from services.common.deadlines import remaining_s
from services.common.identity import PeerIdentity
from services.common.objectives import TPOT_KEY, TTFT_KEY
from services.gateway.calls.generate_core import PRIORITY_KEY, Caller
from services.gateway.calls.stage_timings import REQUEST_START_KEY, parse_request_start_s
from services.gateway.fronts.openai_codec import BadParameter
from services.gateway.tenants.credentials import Authorization, Credentials

if TYPE_CHECKING:  # aiohttp only for the HTTP fronts' types: a gRPC-only gateway never imports it
    from aiohttp import web

AUTHORIZATION_KEY = "authorization"
TIMEOUT_HEADER = "x-infermesh-timeout-ms"
_TRACE_HEADERS = ("traceparent", "tracestate")
# Milliseconds as a plain decimal: no exponent, underscores, spaces, inf or nan (float() takes all of them).
_TIMEOUT_MS = re.compile(r"-?[0-9]+(\.[0-9]+)?")


# --------------------------------------------------------------------------- gRPC metadata


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


@dataclass(frozen=True)
class CallerMetadata:
    authorization: str | None
    # The client's send time (x-request-start), unix seconds; None when it sent none.
    request_start_s: float | None
    # x-infermesh-priority as sent (Generate reads it; generate_core.parse_priority).
    priority: str | bytes | None = None
    # x-infermesh-ttft-ms / x-infermesh-tpot-ms as sent (Generate's latency targets).
    ttft_ms: str | bytes | None = None
    tpot_ms: str | bytes | None = None

    @classmethod
    def read(cls, metadata) -> CallerMetadata:
        """One pass over the metadata: it runs for every request, refused ones included."""
        authorization = request_start = priority = ttft_ms = tpot_ms = None
        for key, value in metadata or ():
            if key == AUTHORIZATION_KEY:
                authorization = _text(value) if authorization is None else f"{authorization}, {_text(value)}"
            elif key == REQUEST_START_KEY:
                request_start = value
            elif key == PRIORITY_KEY:
                priority = value
            elif key == TTFT_KEY:
                ttft_ms = value
            elif key == TPOT_KEY:
                tpot_ms = value
        return cls(authorization, parse_request_start_s(request_start), priority, ttft_ms, tpot_ms)


def grpc_caller(context) -> Caller:
    """The caller of a gRPC request: its metadata, and the client's remaining time (None: no deadline)."""
    metadata = context.invocation_metadata()
    read = CallerMetadata.read(metadata)
    return Caller(_with_peer(read.authorization, context.peer_identities()), read.request_start_s,
                  remaining_s(context), read.priority, metadata, read.ttft_ms, read.tpot_ms)


def grpc_authorization(metadata) -> str | None:
    """The authorization metadata value(s), joined; None when absent."""
    return CallerMetadata.read(metadata).authorization


def grpc_credentials(context) -> Authorization:
    """The authorization value(s) and the verified client certificate's names of a gRPC call."""
    return _with_peer(grpc_authorization(context.invocation_metadata()), context.peer_identities())


def _with_peer(authorization: str | None, names: list[bytes] | None) -> Authorization:
    # peer_identities: the verified certificate's SANs (URIs, DNS names); None without a client certificate.
    if not names:
        return authorization
    return Credentials(authorization, PeerIdentity(tuple(_text(n) for n in names)))


# --------------------------------------------------------------------------- HTTP headers


def http_caller(request: web.Request) -> Caller:
    """The caller of an HTTP request, from its headers. Raises for a malformed x-infermesh-timeout-ms."""
    headers = request.headers
    return Caller(
        authorization=http_authorization(request),
        request_start_s=parse_request_start_s(headers.get(REQUEST_START_KEY)),
        timeout_s=timeout_s_of(headers.get(TIMEOUT_HEADER)),
        priority=headers.get(PRIORITY_KEY),
        metadata=[(name, headers[name]) for name in _TRACE_HEADERS if name in headers],
        ttft_ms=headers.get(TTFT_KEY),
        tpot_ms=headers.get(TPOT_KEY),
    )


def http_authorization(request: web.Request) -> Authorization:
    """The Authorization header(s), joined as the gRPC metadata's are (None when absent), with the
    verified client certificate's names when the connection came with one."""
    values = request.headers.getall("Authorization", [])
    authorization = ", ".join(values) if values else None
    transport = request.transport
    certificate = transport.get_extra_info("peercert") if transport is not None else None
    if not certificate:  # no TLS, no client certificate, or not asked for one (verify_mode CERT_NONE)
        return authorization
    names = tuple(value for kind, value in certificate.get("subjectAltName", ()) if kind in ("URI", "DNS"))
    return Credentials(authorization, PeerIdentity(names))


def timeout_s_of(value: str | None) -> float | None:
    """x-infermesh-timeout-ms in seconds; None when absent. 0 or less is a deadline already passed."""
    if value is None:
        return None
    timeout_ms = float(value) if _TIMEOUT_MS.fullmatch(value) else math.nan
    if not math.isfinite(timeout_ms):
        raise BadParameter(TIMEOUT_HEADER, f"{TIMEOUT_HEADER} must be a number of milliseconds, "
                                           f"got {value[:40]!r}")
    if timeout_ms <= 0:
        raise errors.DeadlineExceeded(f"{TIMEOUT_HEADER} is {timeout_ms:g}: the deadline already passed")
    return timeout_ms / 1000
