"""Every log line about a request carries its ids: request, trace, span (and tenant, or batch).

A handler binds what it knows for the rest of its task: `bind(request_id=..., tenant=...)`, and
more as it learns it (the tenant once auth has said). Every RPC, every call of a Submit stream and
every worker batch runs in a task of its own, so nothing needs unbinding, and lines logged after
the handler returned (the unhandled-error traceback of status.maps_domain_errors) still carry the
request. `RequestFields` adds the fields to every record, with the trace and span of the span
current when the line was logged, else of the request's server span (`remember_span`). asyncio
copies the context into tasks created inside a handler, so their lines carry the request too;
long-lived tasks started on a request's path must start from `clean_context()`.

Formats (`--log-format`):
  text  `2026-11-23 21:40:01,123 gateway WARNING services.gateway.dispatch.dispatcher: message [request_id=... trace_id=...]`,
        the bracket only when something is bound;
  json  one object per line: ts, level, service, logger, message, the ids present, exc_info.

Ids from clients (the request id) are cut to 64 printable characters: a log line cannot be forged
or flooded through them.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
# The record attributes this module sets, in the order text lines show them.
FIELDS = ("request_id", "tenant", "auth", "batch_id", "trace_id", "span_id")
MAX_ID_CHARS = 64


@dataclass(frozen=True)
class Bound:
    request_id: str = ""
    tenant: str = ""
    # How the tenant was recognised (key, jwt, mtls, ...: tenants/credentials.py), never the credential.
    auth: str = ""
    batch_id: str = ""
    # The request's server span, for lines logged where it is no longer current.
    span: trace.SpanContext | None = None


_EMPTY = Bound()
_bound: contextvars.ContextVar[Bound | None] = contextvars.ContextVar("infermesh_log_fields", default=None)


def safe_id(value: object) -> str:
    """A client-chosen id as it may appear in a log line: printable, no spaces, at most 64 characters."""
    text = str(value)[:MAX_ID_CHARS]
    if text.isprintable() and " " not in text:  # the usual id, checked in C (the space is the one printable separator)
        return text
    return "".join(c if c.isprintable() and not c.isspace() else "?" for c in text)


def bind(**fields: object) -> None:
    """These fields (request_id, tenant, batch_id) on every line this task logs from now on."""
    changes: dict[str, Any] = {k: safe_id(v) for k, v in fields.items()}  # Bound's str fields, by name
    _bound.set(replace(_bound.get() or _EMPTY, **changes))


def remember_span() -> None:
    """The current span's ids on this task's later lines, after the span has ended (telemetry.server_span)."""
    current = _bound.get()
    if current is not None:  # only a handler that bound a request: the others' lines need no fallback
        _bound.set(replace(current, span=trace.get_current_span().get_span_context()))


def clean_context() -> contextvars.Context:
    """An empty context for a long-lived task started on a request's path (no ids, no current span)."""
    return contextvars.Context()


class RequestFields(logging.Filter):
    """Sets FIELDS on every record ("" where unknown); installed on the root handler."""

    def filter(self, record: logging.LogRecord) -> bool:
        bound = _bound.get() or _EMPTY
        record.request_id, record.tenant, record.batch_id = bound.request_id, bound.tenant, bound.batch_id
        record.auth = bound.auth
        span = trace.get_current_span().get_span_context()
        if not span.is_valid and bound.span is not None:
            span = bound.span
        if span.is_valid:
            record.trace_id, record.span_id = format(span.trace_id, "032x"), format(span.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{name}={value}" for name in FIELDS if (value := getattr(record, name, "")))
        if not ids:
            return line
        head, newline, rest = line.partition("\n")  # ids on the message line, before any traceback
        return f"{head} [{ids}]{newline}{rest}"


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((name, value) for name in FIELDS if (value := getattr(record, name, "")))
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class ClientGoneBatchErrors(logging.Filter):
    """grpc.aio logs "ExecuteBatchError raised in core by servicer method" at ERROR, with a traceback,
    when a handler's reply or status finds its client gone (it cancelled, its deadline passed, its
    channel closed): every client that hangs up at the wrong moment left one. Nothing failed on our
    side, so it becomes one DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_CLIENT_GONE_PREFIX):
            return True
        logging.getLogger(__name__).debug("a reply found its client gone: %s", message)
        return False


_CLIENT_GONE_PREFIX = "ExecuteBatchError raised in core by servicer method"
_GRPC_AIO_LOGGER = "grpc._cython.cygrpc"
_client_gone = ClientGoneBatchErrors()


def configure_logging(service: str, level: str, log_format: str = "text", stream=None) -> logging.Handler:
    """The root logger's one handler: the format asked for, with the request fields."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else TextFormatter(service))
    handler.addFilter(RequestFields())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger(_GRPC_AIO_LOGGER).addFilter(_client_gone)  # once: a filter is added once per object
    return handler
