"""Request, trace and span ids on every log line about a request; text and JSON formats."""

from __future__ import annotations

import asyncio
import contextvars
import io
import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.common import log_context
from services.common.config import ConfigError, load_config
from services.common.log_context import JsonFormatter, RequestFields, TextFormatter, bind, clean_context
from services.common.telemetry import server_span
from services.scheduler.config import SchedulerConfig


@pytest.fixture
def logged(request):
    """A logger writing through the services' handler setup; returns (logger, the lines so far)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("gateway") if getattr(request, "param", "text") == "json"
                         else TextFormatter("gateway"))
    handler.addFilter(RequestFields())
    logger = logging.getLogger(f"test.log_context.{request.node.name}")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    yield logger, lambda: out.getvalue().splitlines()
    logger.removeHandler(handler)


def test_a_line_outside_any_request_has_no_ids(logged):
    logger, lines = logged
    logger.info("listening on %s", "127.0.0.1:1")
    (line,) = lines()
    assert line.endswith("gateway INFO " + logger.name + ": listening on 127.0.0.1:1")


def in_own_task(function):
    """Runs `function` as a handler does: in a context of its own (bind lasts until it ends)."""
    return contextvars.copy_context().run(function)


def test_text_lines_carry_the_bound_ids_and_the_current_span(logged):
    logger, lines = logged
    tracer = TracerProvider().get_tracer("test")

    def handler():
        bind(request_id="r-1")
        with server_span(tracer, "infermesh.v1.Inference/Classify", None) as span:
            bind(tenant="alpha")
            logger.warning("retrying")
        logger.error("unhandled error")  # as status.maps_domain_errors logs, after the span ended
        return span.get_span_context()

    ctx = in_own_task(handler)
    ids = f"[request_id=r-1 tenant=alpha trace_id={ctx.trace_id:032x} span_id={ctx.span_id:016x}]"
    assert lines()[0].endswith(f"retrying {ids}")
    assert lines()[1].endswith(f"unhandled error {ids}")
    logger.info("after")
    assert lines()[-1].endswith(": after")


@pytest.mark.parametrize("logged", ["json"], indirect=True)
def test_json_is_one_object_per_line_with_the_ids_present(logged):
    logger, lines = logged
    def batch():
        bind(batch_id=12)
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("batch failed")

    in_own_task(batch)
    (line,) = lines()
    entry = json.loads(line)
    assert {k: entry[k] for k in ("level", "service", "logger", "message", "batch_id")} == {
        "level": "ERROR", "service": "gateway", "logger": logger.name, "message": "batch failed", "batch_id": "12"}
    assert "RuntimeError: boom" in entry["exc_info"]
    assert "request_id" not in entry and "trace_id" not in entry


def test_a_client_request_id_cannot_forge_or_flood_a_line(logged):
    logger, lines = logged
    def handler():
        bind(request_id="x\n2026-01-01 gateway ERROR forged" + "a" * 500)
        logger.info("served")

    in_own_task(handler)
    (line,) = lines()
    request_id = line.split("request_id=")[1].rstrip("]")
    assert len(request_id) == log_context.MAX_ID_CHARS and "\n" not in request_id and " " not in request_id


async def test_concurrent_requests_keep_their_own_ids_and_a_clean_task_has_none(logged):
    logger, lines = logged

    async def handle(request_id: str) -> None:
        bind(request_id=request_id)
        await asyncio.sleep(0)
        logger.info("handled")

    async def spawn_background() -> None:
        bind(request_id="c")
        await asyncio.create_task(handle_nothing(logger), context=clean_context())

    await asyncio.gather(handle("a"), handle("b"))
    await asyncio.create_task(spawn_background())
    assert {line.rsplit(" ", 1)[1] for line in lines()[:2]} == {"[request_id=a]", "[request_id=b]"}
    assert lines()[-1].endswith(": background")


async def handle_nothing(logger: logging.Logger) -> None:
    logger.info("background")


def test_log_format_is_text_or_json():
    assert load_config(SchedulerConfig, "scheduler", ["--log-format", "json"], {}).log_format == "json"
    with pytest.raises(ConfigError, match="log_format must be text or json, got 'xml'"):
        load_config(SchedulerConfig, "scheduler", [], {"INFERMESH_SCHEDULER_LOG_FORMAT": "xml"})


def test_no_span_means_no_trace_fields():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    assert trace.get_current_span().get_span_context().is_valid is False
    RequestFields().filter(record)
    assert (record.trace_id, record.span_id, record.request_id) == ("", "", "")


def test_grpcs_client_gone_batch_errors_become_one_debug_line():
    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level  # configure_logging replaces them: put them back after
    log_context.configure_logging("gateway", "INFO", stream=out)
    try:
        grpc_log = logging.getLogger("grpc._cython.cygrpc")
        try:
            raise RuntimeError("batch failed")
        except RuntimeError:
            grpc_log.exception("ExecuteBatchError raised in core by servicer method [/infermesh.v1.Inference/Generate]")
            grpc_log.exception("Unexpected [RuntimeError] raised by servicer method [/x]")  # a real one stays
        lines = out.getvalue().splitlines()
        assert not any("ExecuteBatchError" in line for line in lines)
        assert any("ERROR grpc._cython.cygrpc: Unexpected [RuntimeError]" in line for line in lines)
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
