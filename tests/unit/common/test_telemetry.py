"""server_span: with nothing exporting, no span is made but the caller's trace still propagates."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from services.common import telemetry
from services.common.telemetry import carrier_for, context_from_metadata, server_span

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def not_recording(monkeypatch):
    monkeypatch.setattr(telemetry, "_recording", False)


def test_without_exporter_the_callers_traceparent_is_passed_on(not_recording):
    parent = context_from_metadata([("traceparent", CALLER)])
    with server_span(telemetry.tracer("test"), "hop", parent) as span:
        assert span is trace.INVALID_SPAN
        span.set_attribute("ignored", 1)  # the invalid span accepts and drops attributes
        assert carrier_for()["traceparent"] == CALLER
    assert "traceparent" not in carrier_for()  # the caller's context is current only inside the block


def test_without_exporter_stage_spans_are_skipped(not_recording, monkeypatch):
    started = []
    monkeypatch.setattr(trace.NoOpTracer, "start_span", lambda *a, **k: started.append(a))
    telemetry.record_stage_span(trace.NoOpTracer(), "queue_wait", 0, 10, None)
    telemetry.record_stages_under(trace.NoOpTracer(), "worker", 0, 10, None, [("compute", 1)])
    assert started == []


def test_exception_inside_leaves_no_context_behind(not_recording):
    parent = context_from_metadata([("traceparent", CALLER)])
    with pytest.raises(ValueError), server_span(telemetry.tracer("test"), "hop", parent):
        raise ValueError("boom")
    assert "traceparent" not in carrier_for()
