"""OpenTelemetry: tracer setup from the standard OTEL_* variables, W3C context in gRPC metadata.

Exporter choice, first match wins:
  * `OTEL_SDK_DISABLED=true`: nothing is recorded or exported (trace context still passes through);
  * `OTEL_TRACES_EXPORTER=none|console|otlp` (the standard variable);
  * OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set;
  * a JSON-lines file when `INFERMESH_TRACE_FILE` is set (local runs and tests);
  * otherwise none: spans are still created (so trace ids propagate) but not exported.

OTLP goes over gRPC unless `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or `OTEL_EXPORTER_OTLP_PROTOCOL`)
says `http/protobuf`; any other value is a startup error rather than silently using gRPC.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from services.common import log_context
from services.common.config import ConfigError
from services.common.errors import InfermeshError
from services.common.status import status_code_of

TRACE_FILE_ENV = "INFERMESH_TRACE_FILE"

# False once setup_tracing() found nothing to export spans to: then the hot paths create no spans
# at all (server_span, record_stage_span) and only pass the caller's trace context on.
_recording = True


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span; safe for several processes on one file."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(_span_record(span)) + "\n" for span in spans)
        with self._lock, open(self._path, "a", encoding="utf-8") as out:
            out.write(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    assert ctx is not None  # every span the SDK ends has one
    return {
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
    }


OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    """`OTEL_SDK_DISABLED`, read as the specification says: only "true" (any case) disables."""
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def otlp_protocol(environ: Mapping[str, str]) -> str:
    """The OTLP transport for traces: the signal-specific variable wins over the general one."""
    raw = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    protocol = raw.strip().lower()
    if protocol not in OTLP_PROTOCOLS:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={raw!r} is not supported: use one of {', '.join(OTLP_PROTOCOLS)}")
    return protocol


def setup_tracing(service_name: str, environ: Mapping[str, str] | None = None) -> TracerProvider:
    global _recording
    provider, _recording = build_provider(service_name, os.environ if environ is None else environ)
    trace.set_tracer_provider(provider)
    return provider


def build_provider(service_name: str, environ: Mapping[str, str]) -> tuple[TracerProvider, bool]:
    """The tracer provider the variables ask for, and whether it records spans at all."""
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", service_name)})
    disabled = sdk_disabled(environ)
    processor = None if disabled else _span_processor(environ)
    recording = processor is not None or ("OTEL_TRACES_SAMPLER" in environ and not disabled)
    if not recording:
        # Nothing exports: spans need not be recorded (10-25 us each), only their ids propagated.
        provider = TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    else:
        provider = TracerProvider(resource=resource)
    if processor is not None:
        provider.add_span_processor(processor)
    return provider, recording


def _span_processor(environ: Mapping[str, str]):
    choice = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    has_endpoint = "OTEL_EXPORTER_OTLP_ENDPOINT" in environ or "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in environ
    if choice == "none":
        return None
    if choice == "console":
        return SimpleSpanProcessor(ConsoleSpanExporter())
    if choice == "otlp" or (not choice and has_endpoint):
        if otlp_protocol(environ) == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            return BatchSpanProcessor(HttpExporter())
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return BatchSpanProcessor(OTLPSpanExporter())
    if choice not in ("", "none"):
        raise ConfigError(f"OTEL_TRACES_EXPORTER={choice!r} is not supported: use otlp, console or none")
    if environ.get(TRACE_FILE_ENV):
        return SimpleSpanProcessor(JsonLinesSpanExporter(environ[TRACE_FILE_ENV]))
    return None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context from incoming gRPC metadata (traceparent, tracestate)."""
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return propagate.extract(carrier)


def edge_parent(caller: otel_context.Context, trusted: bool) -> tuple[otel_context.Context, tuple[trace.Link, ...]]:
    """The parent of an edge's server span, and the links it starts with.

    A trusted caller's context is followed: its trace, its sampling decision. An untrusted one (any
    client on the internet) could otherwise force every request it sends to be recorded, or hide
    them, and choose their trace ids: its request starts a fresh trace that this process's sampler
    decides, and the span it sent (if valid) becomes a link, so the two traces still join. Its
    baggage is dropped with it.
    """
    sent = trace.get_current_span(caller).get_span_context()
    if not sent.is_valid:
        return _fresh_root(), ()
    if trusted:
        return caller, ()
    return _fresh_root(), (trace.Link(sent, {"infermesh.trace_context": "untrusted"}),)


_ids = RandomIdGenerator()


def _fresh_root() -> otel_context.Context:
    if _recording:
        return otel_context.Context()  # no parent: the provider's sampler decides, ids come with the span
    # Nothing is recorded, so no span makes ids: mint an unsampled context so every hop's log lines
    # and the downstream traceparent still share one trace id.
    minted = trace.SpanContext(_ids.generate_trace_id(), _ids.generate_span_id(), is_remote=False,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.DEFAULT))
    return trace.set_span_in_context(trace.NonRecordingSpan(minted), otel_context.Context())


def context_from_carrier(carrier: Mapping[str, str]) -> otel_context.Context:
    return propagate.extract(dict(carrier))


def carrier_for(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C headers for the given (or current) context, to put on an outgoing call or message."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def metadata_for(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...]:
    return tuple(carrier_for(ctx).items())


def rpc_attributes(full_method: str) -> dict[str, str]:
    """OpenTelemetry's RPC semantic conventions for "package.Service/Method"."""
    service, _, method = full_method.partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


@dataclass(frozen=True, slots=True)
class Attachment:
    """One `otel_context.attach`, with what undoing it needs to know."""

    token: contextvars.Token[otel_context.Context]
    context: otel_context.Context
    task: asyncio.Task | None  # the task that attached; None outside a running event loop


def attach(context: otel_context.Context) -> Attachment:
    return Attachment(otel_context.attach(context), context, _current_task())


def detach(attachment: Attachment) -> None:
    """Undo `attach`, unless the block is being closed from another task.

    grpc.aio closes a streaming handler cancelled mid-stream (an async generator) from a task of its
    own, and the asyncgen finalizer closes a dropped one from a new task whose context may be a copy
    taken while the span was current. Detaching there raises inside OpenTelemetry (the token belongs
    to another Context), which logs "Failed to detach context" at ERROR with a traceback for every
    cancelled stream. That task has nothing of ours to undo, and the handler's own context ends with
    its task.
    """
    if _current_task() is attachment.task and otel_context.get_current() is attachment.context:
        otel_context.detach(attachment.token)


def _current_task() -> asyncio.Task | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running event loop
        return None


def grpc_status_code(exc: BaseException | None) -> int:
    """The gRPC status a handler's outcome maps to, as the integer `rpc.grpc.status_code` wants."""
    if exc is None:
        return 0
    if isinstance(exc, InfermeshError):
        return status_code_of(exc).value[0]
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return 1  # CANCELLED
    return 13  # INTERNAL: what the client sees of an unexpected exception


class server_span:  # noqa: N801 - used like the tracer's own context manager
    """A hop's SERVER span under `parent`, current while the block runs.

    `name` is the RPC's full method ("infermesh.v1.Inference/Classify"), the span name the
    OpenTelemetry RPC conventions ask for; the span carries rpc.system, rpc.service, rpc.method and,
    when the block ends, the integer rpc.grpc.status_code (0 unless an exception left the block).

    When this process exports no spans, it makes `parent` current instead and yields the invalid
    span (whose setters do nothing): outgoing calls still carry the caller's trace, and a request
    pays no span at all (about 5% of the scheduler's CPU per classify request). An exception
    leaving the block marks the span ERROR without recording its traceback (formatting one per
    refused request cost more than serving a request).
    """

    __slots__ = ("_tracer", "_name", "_parent", "_links", "_span", "_attachment")

    def __init__(self, tracer_: trace.Tracer, name: str, parent: otel_context.Context | None,
                 links: Sequence[trace.Link] = ()) -> None:
        self._tracer, self._name, self._parent = tracer_, name, parent  # None: the current context
        self._links = links

    def __enter__(self) -> trace.Span:
        if _recording:
            self._span = self._tracer.start_span(self._name, context=self._parent, kind=trace.SpanKind.SERVER,
                                                 attributes=rpc_attributes(self._name), links=self._links)
            attached = trace.set_span_in_context(self._span, self._parent)
        else:
            self._span = trace.INVALID_SPAN
            attached = otel_context.get_current() if self._parent is None else self._parent
        self._attachment = attach(attached)
        log_context.remember_span()
        return self._span

    def __exit__(self, exc_type, exc, tb) -> None:
        detach(self._attachment)
        if not _recording:
            return
        code = grpc_status_code(exc)
        self._span.set_attribute("rpc.grpc.status_code", code)
        if exc is not None and code != 0:
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
        self._span.end()


def record_stage_span(
    tracer_: trace.Tracer,
    name: str,
    start_ns: int,
    end_ns: int,
    parent: otel_context.Context | None,
    attributes: Mapping[str, str | int | float] | None = None,
) -> None:
    """A span for a stage measured after the fact (queue wait, batch wait, compute)."""
    if not _recording:
        return
    span = tracer_.start_span(name, context=parent, start_time=start_ns, attributes=dict(attributes or {}))
    span.end(end_time=end_ns)


def record_stages_under(
    tracer_: trace.Tracer,
    name: str,
    start_ns: int,
    end_ns: int,
    parent: otel_context.Context | None,
    stages: Sequence[tuple[str, int]],
    attributes: Mapping[str, str | int | float] | None = None,
) -> None:
    """One span for a hop's work with one child per stage, laid end to end from start_ns.

    stages: (stage name, duration in microseconds), in the order they ran.
    """
    if not _recording:
        return
    span = tracer_.start_span(name, context=parent, start_time=start_ns, attributes=dict(attributes or {}))
    inside = trace.set_span_in_context(span)
    cursor_ns = start_ns
    for stage, duration_us in stages:
        stage_end_ns = min(end_ns, cursor_ns + duration_us * 1000)
        record_stage_span(tracer_, stage, cursor_ns, stage_end_ns, inside)
        cursor_ns = stage_end_ns
    span.end(end_time=end_ns)
