"""The OpenAI HTTP target against a fake OpenAI server: what it sends, how it times and counts, and
that coordinated omission stays absent over HTTP as it does over gRPC."""

from __future__ import annotations

import pytest

from loadtest.records import CLIENT_QUEUE, OK
from loadtest.runner import LoadRunner, MonotonicClock
from loadtest.scenario import Slo, parse_scenario
from loadtest.stats import LatencyHistogram, summarize_group
from loadtest.targets.factory import open_target

STALL_S = 0.6


def _scenario(rate_rps: float = 20, duration_s: float = 0.5, max_in_flight: int = 0, **klass) -> object:
    return parse_scenario({
        "name": "http", "duration_s": duration_s, "warmup_s": 0, "seed": 3,
        "load": {"mode": "open", "arrival": "constant", "rate_rps": rate_rps, "max_in_flight": max_in_flight},
        "tenants": [{"name": "alpha", "api_key": "key-a"}],
        "classes": [{"name": "gen", "kind": "generate", "model": "tinylm", "deadline_ms": 5000, "prompt_len": 8,
                     "output_len": 5, "slo": {"e2e_ms": 100}, **klass}],
    })


async def _run(url: str, scenario):
    target = open_target(url, scenario, MonotonicClock(), "t")
    try:
        return await LoadRunner(scenario, target).run()
    finally:
        await target.close()


async def test_streamed_completion_times_every_content_chunk_and_takes_the_usage_count(fake_openai):
    server, url = await fake_openai(chunk_text="ab")
    result = await _run(url, _scenario())
    assert result.records and all(r.ok for r in result.records)
    record = result.records[0]
    assert len(record.chunk_times_s) == 5 and record.num_output_tokens == 5  # usage, not the 10 bytes of text
    assert record.ttft_s is not None and record.tpot_s is not None and len(record.itl_s) == 4
    body, headers = server.bodies[0], server.headers[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] and body["max_tokens"] == 5 and body["ignore_eos"] is True and body["seed"] == 0
    assert headers["Authorization"] == "Bearer key-a" and headers["x-request-start"].startswith("t=")
    assert 4000 < int(headers["x-infermesh-timeout-ms"]) <= 5000  # the deadline, less any wait in the generator


async def test_without_usage_the_scenario_tokenizer_counts_the_text(fake_openai):
    server, url = await fake_openai(chunk_text="ab", send_usage=False)
    result = await _run(url, _scenario())
    assert all(r.ok and r.num_output_tokens == 10 for r in result.records)  # bytes tokenizer: 5 chunks x 2 bytes


async def test_whole_chat_reply_reads_the_message_and_server_timing(fake_openai):
    server, url = await fake_openai(server_timing=True)
    result = await _run(url, _scenario(api="chat", stream=False))
    record = result.records[0]
    assert record.ok and record.num_output_tokens == 5 and record.chunk_times_s == (record.done_s,)
    assert server.bodies[0]["messages"] == [{"role": "user", "content": server.bodies[0]["messages"][0]["content"]}]
    assert "stream_options" not in server.bodies[0]
    assert {(s.stage, s.duration_us) for s in record.stages} == {("queue", 500), ("compute", 1250)}
    assert record.server_total_us > 0


async def test_an_http_refusal_is_recorded_with_its_status_and_message(fake_openai):
    server, url = await fake_openai(rejected_keys=frozenset({"key-a"}))
    result = await _run(url, _scenario())
    assert result.records and all(r.status == "HTTP_429" for r in result.records)
    assert "rate limited: key-a" in result.records[0].message


async def test_readiness_lists_the_served_models(fake_openai):
    server, url = await fake_openai(models=("tinylm", "other"))
    target = open_target(url, _scenario(), MonotonicClock(), "t")
    try:
        assert await target.ready_models({"tinylm", "missing"}, "key-a", 2.0) == {"tinylm"}
    finally:
        await target.close()


def test_a_classify_class_is_refused_for_an_openai_target():
    scenario = parse_scenario({
        "load": {"rate_rps": 1}, "tenants": [{"api_key": "k"}],
        "classes": [{"name": "c", "kind": "classify", "model": "digits"}]})
    with pytest.raises(ValueError, match="OpenAI target .* serves generate classes only"):
        open_target("openai+http://127.0.0.1:9/v1", scenario, MonotonicClock(), "t")


async def test_scheduled_time_latency_shows_an_http_stall_that_service_time_hides(fake_openai):
    """The gRPC stall test (test_coordinated_omission.py) over HTTP: one request in flight, a 0.6 s stall."""
    server, url = await fake_openai(token_s=0.0005, stall_on_call=25, stall_s=STALL_S)
    result = await _run(url, _scenario(rate_rps=50, duration_s=2.0, max_in_flight=1, output_len=1, stream=False))
    records = result.records
    assert len(records) == 99 and all(r.status == OK for r in records)
    slow_service = [r for r in records if r.service_s >= STALL_S * 0.9]  # not > 0.2 s: a loaded box serves some that slowly
    slow_latency = [r for r in records if r.latency_s > 0.2]
    assert len(slow_service) == 1
    assert len(slow_latency) >= 20
    # The stall's backlog (0.6 s at 50/s, one in flight) waited in the client's queue. Not "every slow
    # one": on a loaded box a few are slow to serve on their own (failed in a 2-process suite run).
    assert len([r for r in slow_latency if r.client_queue_s > 0.1]) >= 20
    latency = LatencyHistogram(r.latency_s * 1e6 for r in records).summary_ms()
    service = LatencyHistogram(r.service_s * 1e6 for r in records).summary_ms()
    assert latency["p90"] > 200 and latency["max"] >= STALL_S * 900 and service["p90"] < 50
    group = summarize_group(records, result.measured_s, lambda r: Slo(e2e_ms=100), Slo(e2e_ms=100))
    assert group["goodput_ratio"] < 0.8
    assert group["stages"][CLIENT_QUEUE]["mean_ms"] > group["stages"]["other"]["mean_ms"]


async def test_open_loop_keeps_sending_over_http_through_a_stall(fake_openai):
    server, url = await fake_openai(token_s=0.0005, stall_on_call=25, stall_s=STALL_S)
    result = await _run(url, _scenario(rate_rps=50, duration_s=2.0, output_len=1, stream=False))
    assert server.num_calls == 99
    # Several requests were in the server's stall at once: none waited for another's reply.
    stalled = [r for r in result.records if r.service_s > STALL_S / 3]
    assert len(stalled) >= 2
    # Each left when the generator woke for it (its lag), not when the stall ended. Relative to the
    # lag, not absolute: on the loaded shared box the generator itself is sometimes late by 0.6 s.
    assert_sent_when_due(result)


def assert_sent_when_due(result) -> None:
    """No request waited in the harness longer than the generator's own lag for it, plus a margin
    for its task to start (the stall would add up to STALL_S). Warm-up 0: lag i is request i's."""
    lag_s = [lag_us / 1e6 for lag_us in result.lag_us]
    late = [(r.seq, round(r.client_queue_s, 3), round(lag_s[r.seq], 3)) for r in result.records
            if r.client_queue_s > lag_s[r.seq] + STALL_S / 2]
    assert not late, late


async def test_each_request_carries_its_own_traceparent_and_the_report_lists_the_slowest(fake_openai):
    from loadtest.report_json import build_report

    server, url = await fake_openai()
    scenario = _scenario()
    result = await _run(url, scenario)
    sent = [h["traceparent"] for h in server.headers]
    assert len(set(sent)) == len(sent) == len(result.records)
    for header in sent:
        version, trace_id, span_id, flags = header.split("-")
        assert (version, flags, len(trace_id), len(span_id)) == ("00", "01", 32, 16) and int(span_id, 16) > 0
    assert {r.trace_id for r in result.records} == {h.split("-")[1] for h in sent}
    doc = build_report(scenario, result, target=url, started_at="2026-01-01T00:00:00+00:00")
    slowest = doc["slowest"]
    assert 0 < len(slowest) <= 10
    assert slowest[0]["latency_ms"] == pytest.approx(max(r.latency_s for r in result.records) * 1000, abs=1e-3)
    assert [s["latency_ms"] for s in slowest] == sorted((s["latency_ms"] for s in slowest), reverse=True)
    assert all(s["trace_id"] in {r.trace_id for r in result.records} for s in slowest)
