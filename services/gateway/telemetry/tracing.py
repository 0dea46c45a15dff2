"""The gateway's tracer and `span`, the cheap child span every stage of a request opens
(auth, routing, quota, admission, each attempt)."""

from __future__ import annotations

from opentelemetry import trace

from services.common.telemetry import Attachment, attach, detach

TRACER = trace.get_tracer("infermesh.gateway")


class span:  # noqa: N801 - used like the tracer's own context manager
    """A child span of the current one, current while the block runs.

    Cheaper than `start_as_current_span` on the refusal path, which is what matters there:
    no generator-based context managers, and exceptions are not recorded (formatting a
    traceback per span made a refused request cost more than a served one). The request's
    server span carries the final status code instead.
    """

    __slots__ = ("_name", "_attributes", "_kind", "_span", "_attachment")

    def __init__(self, name: str, kind: trace.SpanKind = trace.SpanKind.INTERNAL, **attributes) -> None:
        self._name = name
        self._kind = kind
        self._attributes = attributes or None

    def __enter__(self) -> trace.Span:
        parent = trace.get_current_span()
        if not parent.is_recording():
            # The request's trace is not sampled: its children would not be either, so skip them.
            self._span = None
            return parent
        self._span = TRACER.start_span(self._name, kind=self._kind, attributes=self._attributes)
        self._attachment: Attachment = attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._span is not None:
            detach(self._attachment)
            self._span.end()
