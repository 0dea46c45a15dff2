"""server_span: with nothing exporting, no span is made but the caller's trace still propagates."""

from __future__ import annotations

import pytest
from opentelemetry import trace

from services.common import telemetry
from services.common.config import ConfigError
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


def test_recording_span_is_a_child_of_the_caller_and_an_error_keeps_no_traceback(monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setattr(telemetry, "_recording", True)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent = context_from_metadata([("traceparent", CALLER)])
    with pytest.raises(ValueError), server_span(provider.get_tracer("test"), "hop", parent) as span:
        assert carrier_for()["traceparent"].split("-")[1] == CALLER.split("-")[1]  # same trace, our span id
        raise ValueError("boom")
    (finished,) = exporter.get_finished_spans()
    assert finished is not None and span.get_span_context().span_id == finished.context.span_id
    assert format(finished.parent.span_id, "016x") == CALLER.split("-")[2]
    assert finished.kind is trace.SpanKind.SERVER
    assert finished.status.status_code is trace.StatusCode.ERROR and finished.events == ()
    assert "traceparent" not in carrier_for()



@pytest.mark.parametrize("recording", [False, True])
async def test_a_stream_closed_from_another_task_detaches_quietly_and_still_ends_its_span(
        monkeypatch, caplog, recording):
    """grpc.aio closes a cancelled streaming handler from a task of its own: no "Failed to detach
    context" ERROR per cancelled stream, the span still ends, and the closing task's context is
    left as it was."""
    import asyncio

    ended = []
    monkeypatch.setattr(telemetry, "_recording", recording)
    tracer_ = telemetry.tracer("test")
    if recording:
        from opentelemetry.sdk.trace import TracerProvider
        tracer_ = TracerProvider().get_tracer("test")
    parent = context_from_metadata([("traceparent", CALLER)])

    async def handler():
        with server_span(tracer_, "infermesh.v1.Inference/Generate", parent) as span:
            try:
                yield carrier_for()["traceparent"]
                yield "never"
            finally:
                ended.append(span)

    stream = handler()
    first = await asyncio.create_task(stream.__anext__())
    assert first.split("-")[1] == CALLER.split("-")[1]
    await asyncio.create_task(stream.aclose())
    assert [r for r in caplog.records if r.levelname == "ERROR"] == []
    assert len(ended) == 1 and "traceparent" not in carrier_for()
    if recording:
        assert ended[0].end_time is not None

async def test_a_stream_closed_from_a_copy_of_its_own_context_detaches_quietly(caplog):
    """The asyncgen finalizer (or a callback) may close a dropped stream from a new task whose context
    was copied while the stream's span was current: same attached context, but its token belongs to
    another Context, and OpenTelemetry's detach logs "Failed to detach context" at ERROR."""
    import asyncio
    import contextvars

    captured: list[contextvars.Context] = []

    async def handler():
        with server_span(telemetry.tracer("test"), "infermesh.v1.Inference/Generate", None):
            captured.append(contextvars.copy_context())
            yield 1
            yield 2

    stream = handler()
    await asyncio.create_task(stream.__anext__())
    await asyncio.get_running_loop().create_task(stream.aclose(), context=captured[0])
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


# -- the standard OTEL_* variables ------------------------------------------------------


def _exporter_of(environ):
    processor = telemetry._span_processor(environ)
    return None if processor is None else type(processor.span_exporter).__module__


def test_otlp_protocol_selects_the_transport():
    assert "proto.grpc" in _exporter_of({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    http = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert "proto.http" in _exporter_of(http)
    # The traces-specific variable wins over the general one.
    assert "proto.grpc" in _exporter_of({**http, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"})


@pytest.mark.parametrize("environ", [
    {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "thrift"},
    {"OTEL_TRACES_EXPORTER": "jaeger"},
])
def test_unsupported_values_are_a_configuration_error_not_a_silent_default(environ):
    with pytest.raises(ConfigError, match="is not supported"):
        telemetry._span_processor(environ)


@pytest.mark.parametrize(("value", "disabled"), [("true", True), ("TRUE", True), ("false", False), ("1", False), ("", False)])
def test_sdk_disabled_reads_only_true(value, disabled):
    assert telemetry.sdk_disabled({"OTEL_SDK_DISABLED": value}) is disabled


def test_sdk_disabled_records_nothing_even_with_an_exporter_configured():
    provider, recording = telemetry.build_provider("svc", {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "console",
                                                           "OTEL_TRACES_SAMPLER": "always_on"})
    assert recording is False
    assert not provider.get_tracer("t").start_span("x").is_recording()
    _, recording = telemetry.build_provider("svc", {"OTEL_TRACES_EXPORTER": "console"})
    assert recording is True


# -- RPC semantic conventions ---------------------------------------------------------------


def test_rpc_attributes_split_the_full_method():
    assert telemetry.rpc_attributes("infermesh.v1.Scheduler/Generate") == {
        "rpc.system": "grpc", "rpc.service": "infermesh.v1.Scheduler", "rpc.method": "Generate"}


def test_status_code_is_the_integer_the_client_sees():
    import asyncio

    from services.common import errors

    assert telemetry.grpc_status_code(None) == 0
    assert telemetry.grpc_status_code(errors.InvalidArgument("bad")) == 3
    assert telemetry.grpc_status_code(errors.Unavailable("down")) == 14
    assert telemetry.grpc_status_code(asyncio.CancelledError()) == 1
    assert telemetry.grpc_status_code(RuntimeError("bug")) == 13
