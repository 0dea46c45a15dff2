"""Every admission status of the gateway, with its exact message shape, against real processes.

One mesh for the module: scheduler, a toy classifier (200 ms per batch, so the gateway learns a
minimum service time), a toy generator (50 ms per step, to hold requests in flight), and a gateway
with a tenants file, a limit of 4 requests in flight, and sheddable traffic shed from 50% in use.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import (
    BRIGHT,
    CLASSIFIER,
    GENERATOR,
    bearer,
    scheduler_pressure,
    scrape,
    status_of,
    tenant,
    write_tenants,
)
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = pytest.mark.integration

KEYS = {name: f"{name}-secret-key-0123" for name in
        ("gold", "silver", "narrow", "ratelimited", "tokens", "single", "cheap")}
MAX_IN_FLIGHT = 4


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway-auth-quota")
    tenants = write_tenants(tmp / "tenants.yaml", [
        tenant("gold", KEYS["gold"], "critical"),
        tenant("silver", KEYS["silver"], "standard"),
        tenant("narrow", KEYS["narrow"], "standard", ["toy-generator"]),
        tenant("ratelimited", KEYS["ratelimited"], "standard", requests_per_s=0.5, requests_burst=1),
        tenant("tokens", KEYS["tokens"], "standard", ["toy-generator"], tokens_per_s=0.01, tokens_burst=40),
        tenant("single", KEYS["single"], "standard", max_in_flight=1),
        tenant("cheap", KEYS["cheap"], "sheddable"),
    ])
    with running_mesh(tmp, env={"INFERMESH_TRACE_FILE": str(tmp / "spans.jsonl")}) as mesh:
        mesh.metrics_port = free_port()
        mesh.trace_file = tmp / "spans.jsonl"
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier", "--toy-compute-ms", "200")
        mesh.start_worker("toy-generator", "--toy-compute-ms", "50")
        mesh.start_gateway(
            "--tenants-file", str(tenants), "--metrics-port", str(mesh.metrics_port),
            "--max-in-flight", str(MAX_IN_FLIGHT), "--shed-in-flight-at", "0.5,0.9",
            "--pressure-poll-interval-ms", "100",
        )
        yield mesh


@pytest.fixture(scope="module")
def stub(mesh):
    with session_tls.channel(mesh.gateway.address) as channel:
        yield gateway_pb2_grpc.InferenceStub(channel)


def _classify(stub, key: str | None, model=CLASSIFIER, timeout_s: float = 10):
    metadata = bearer(key) if key is not None else ()
    return lambda: stub.Classify(gateway_pb2.ClassifyRequest(model=model, image=BRIGHT), timeout=timeout_s,
                                 metadata=metadata)


def _generate(stub, key: str, max_tokens: int, prompt: str = "abc", stop=(), timeout_s: float = 10):
    request = gateway_pb2.GenerateRequest(
        model=GENERATOR, prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens, stop=list(stop))
    )
    return stub.Generate(request, timeout=timeout_s, metadata=bearer(key))


class _Holders:
    """Generate streams kept open (50 ms per token) to fill the gateway's in-flight slots."""

    def __init__(self, stub, mesh, key: str, count: int) -> None:
        self.port = mesh.metrics_port
        self.scheduler = mesh.scheduler.address
        before = scrape(self.port).value("infermesh_gateway_in_flight_requests")
        self.calls = [_generate(stub, key, max_tokens=200, prompt="a", timeout_s=30) for _ in range(count)]
        wait_until(lambda: scrape(self.port).value("infermesh_gateway_in_flight_requests") >= before + count,
                   timeout_s=10, message=f"{count} streams in flight")

    def _kv_usage(self) -> float:
        return scheduler_pressure(self.scheduler, "toy-generator").kv_usage

    def release(self) -> None:
        """Cancel the streams: the gateway frees its slots and cancels upstream, so the scheduler
        frees the sequences' KV blocks (they would otherwise run for 10 s)."""
        wait_until(lambda: self._kv_usage() > 0, timeout_s=10, message="sequences hold KV blocks")
        for call in self.calls:
            call.cancel()
        wait_until(lambda: scrape(self.port).value("infermesh_gateway_in_flight_requests") == 0,
                   timeout_s=10, message="in-flight slots released by cancellation")
        wait_until(lambda: self._kv_usage() == 0, timeout_s=5, message="scheduler freed the cancelled sequences")


# --------------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing API key: send metadata 'authorization: Bearer <key>'"),
        ((("authorization", "Basic abc"),), "malformed authorization metadata: expected 'Bearer <key>'"),
        (bearer("not-a-key"), "invalid API key"),
        # Two keys: neither wins silently, in either order.
        (bearer("not-a-key") + bearer(KEYS["gold"]), "more than one authorization value: send one 'Bearer <key>'"),
        (bearer(KEYS["gold"]) + bearer("not-a-key"), "more than one authorization value: send one 'Bearer <key>'"),
    ],
)
def test_missing_malformed_or_wrong_key_is_unauthenticated(stub, metadata, message):
    got = status_of(lambda: stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=10,
                                          metadata=metadata))
    assert (got.code, got.message) == (grpc.StatusCode.UNAUTHENTICATED, message)


def test_a_bad_request_is_checked_only_once_its_caller_is_authenticated(stub):
    # Without a key, what is wrong with the request stays unsaid; with one, it is the answer.
    def empty_prompt(metadata):
        request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="")
        return lambda: list(stub.Generate(request, timeout=10, metadata=metadata))

    unknown = status_of(empty_prompt(bearer("not-a-key")))
    assert (unknown.code, unknown.message) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
    known = status_of(empty_prompt(bearer(KEYS["gold"])))
    assert (known.code, known.message) == (grpc.StatusCode.INVALID_ARGUMENT, "prompt must not be empty")
    no_model = status_of(lambda: stub.Classify(gateway_pb2.ClassifyRequest(image=BRIGHT), timeout=10,
                                               metadata=bearer("not-a-key")))
    assert no_model.code == grpc.StatusCode.UNAUTHENTICATED


def test_n_and_tool_choice_checked_before_admission_still_say_unauthenticated_first(stub):
    def too_many(metadata):
        request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc", n=17, tool_choice="f")
        return lambda: list(stub.Generate(request, timeout=10, metadata=metadata))

    unknown = status_of(too_many(bearer("not-a-key")))
    assert (unknown.code, unknown.message) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
    known = status_of(too_many(bearer(KEYS["gold"])))
    assert (known.code, known.message) == (grpc.StatusCode.INVALID_ARGUMENT, "tool_choice needs tools")


def test_valid_key_is_served_and_its_tenant_reaches_the_scheduler(stub, mesh):
    reply = _classify(stub, KEYS["gold"])()
    assert reply.labels[0].label == "bright"

    def scheduler_saw_gold():
        lines = mesh.trace_file.read_text().splitlines() if mesh.trace_file.exists() else []
        spans = [json.loads(line) for line in lines]
        return any(s["name"] == "infermesh.v1.Scheduler/Classify" and s["attributes"].get("infermesh.tenant") == "gold"
                   for s in spans)

    wait_until(scheduler_saw_gold, timeout_s=10, message="scheduler span tagged with tenant gold")


def test_gateway_spans_cover_auth_quota_routing_and_each_attempt(stub, mesh):
    _classify(stub, KEYS["silver"])()

    def names_in_silver_trace():
        spans = [json.loads(line) for line in mesh.trace_file.read_text().splitlines()]
        gateway = [s for s in spans if s["service"] == "gateway"]
        by_trace: dict[str, set[str]] = {}
        for span in gateway:
            by_trace.setdefault(span["trace_id"], set()).add(span["name"])
        return [names for names in by_trace.values() if {"auth", "quota", "routing", "attempt"} <= names]

    wait_until(names_in_silver_trace, timeout_s=10, message="gateway spans auth, quota, routing, attempt")
    spans = [json.loads(line) for line in mesh.trace_file.read_text().splitlines()]
    attempts = [s for s in spans if s["service"] == "gateway" and s["name"] == "attempt"]
    assert attempts[-1]["attributes"]["infermesh.attempt"] == 1
    assert attempts[-1]["attributes"]["infermesh.endpoint"] == mesh.scheduler.address


def test_api_keys_never_reach_the_gateway_log(stub, mesh):
    status_of(_classify(stub, "leaked-key-should-not-be-logged"))
    log = (mesh.tmp / "gateway.log").read_text()
    assert "leaked-key-should-not-be-logged" not in log
    assert all(key not in log for key in KEYS.values())


def test_model_not_allowed_is_permission_denied(stub):
    got = status_of(_classify(stub, KEYS["narrow"]))
    assert (got.code, got.message) == (
        grpc.StatusCode.PERMISSION_DENIED, "tenant 'narrow' may not use model 'toy-classifier'"
    )


def test_tokenize_is_authenticated_and_limited_to_the_tenants_models_but_not_charged(stub):
    def tokenize(key: str, model: str = "toy-generator"):
        return lambda: stub.Tokenize(gateway_pb2.TokenizeRequest(model=common_pb2.ModelRef(name=model), prompt="a" * 60),
                                     metadata=bearer(key), timeout=10)

    assert status_of(tokenize("wrong-key")).code == grpc.StatusCode.UNAUTHENTICATED
    got = status_of(tokenize(KEYS["narrow"], "toy-classifier"))
    assert (got.code, got.message) == (
        grpc.StatusCode.PERMISSION_DENIED, "tenant 'narrow' may not use model 'toy-classifier'")
    # 'tokens' has a burst of 40 tokens and 'ratelimited' half a request a second: tokenizing is neither.
    for key in ("tokens", "ratelimited"):
        assert [len(tokenize(KEYS[key])().token_ids) for _ in range(3)] == [60, 60, 60]
    detokenized = stub.Detokenize(gateway_pb2.DetokenizeRequest(model=GENERATOR, token_ids=[104, 105]),
                                  metadata=bearer(KEYS["narrow"]), timeout=10)
    assert detokenized.text == "hi"


def test_unknown_model_is_not_found(stub):
    got = status_of(_classify(stub, KEYS["gold"], model=common_pb2.ModelRef(name="nope")))
    assert (got.code, got.message) == (grpc.StatusCode.NOT_FOUND, "model 'nope' is not served here")


# --------------------------------------------------------------------------- quotas


def test_over_request_rate_is_resource_exhausted_with_retry_info_and_pushback(stub, mesh):
    before = scrape(mesh.metrics_port)
    _classify(stub, KEYS["ratelimited"])()
    got = status_of(_classify(stub, KEYS["ratelimited"]))
    assert got.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got.message.startswith(
        "tenant 'ratelimited' is over its request rate quota (0.5 requests/s, burst 1); retry after "
    )
    assert got.message.endswith(" s")
    assert 1.0 < got.retry_delay_s <= 2.0
    assert 1000 < got.pushback_ms <= 2000
    after = scrape(mesh.metrics_port)
    rejected = dict(tenant="ratelimited", quota="requests_per_s")
    assert after.value("infermesh_gateway_quota_rejections_total", **rejected) == \
        before.value("infermesh_gateway_quota_rejections_total", **rejected) + 1
    counted = dict(tenant="ratelimited", model="toy-classifier", method="Classify")
    assert after.value("infermesh_gateway_requests_total", code="RESOURCE_EXHAUSTED", **counted) == \
        before.value("infermesh_gateway_requests_total", code="RESOURCE_EXHAUSTED", **counted) + 1
    assert after.value("infermesh_gateway_requests_total", code="OK", **counted) == \
        before.value("infermesh_gateway_requests_total", code="OK", **counted) + 1


def test_generate_larger_than_token_burst_is_refused_without_retry_hint(stub):
    got = status_of(lambda: _generate(stub, KEYS["tokens"], max_tokens=57))  # 3 prompt bytes + 2 + 57
    assert (got.code, got.message) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "request needs 62 tokens (prompt + max_tokens) but tenant 'tokens' may use at most 40 at once; "
        "lower max_tokens",
    )
    assert got.pushback_ms is None and got.retry_delay_s is None


def test_generate_is_charged_prompt_plus_max_tokens_and_refunded_what_it_did_not_use(stub):
    # Burst 40, refill ~0: each call is charged 5 + 20 = 25 up front (3 prompt bytes + 2). It stops at "f" after
    # a few tokens, so most of the charge comes back; without the refund the second call would
    # find only 15 tokens left.
    for _ in range(2):
        chunks = list(_generate(stub, KEYS["tokens"], max_tokens=20, stop=["f"]))
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        assert "".join(c.text for c in chunks) == "de"
    got = status_of(lambda: _generate(stub, KEYS["tokens"], max_tokens=35))  # needs 40 > what is left
    assert got.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert got.message.startswith(
        "tenant 'tokens' is over its token rate quota (0.01 tokens/s, burst 40): request needs 40 tokens; "
        "retry after "
    )
    assert got.retry_delay_s > 100 and got.pushback_ms > 100_000


def test_tenant_in_flight_quota_is_resource_exhausted(stub, mesh):
    holders = _Holders(stub, mesh, KEYS["single"], 1)
    try:
        got = status_of(_classify(stub, KEYS["single"]))
    finally:
        holders.release()
    assert (got.code, got.message) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant 'single' has 1 requests in flight (limit 1)"
    )
    assert got.pushback_ms == 100 and got.retry_delay_s == 0.1
    assert _classify(stub, KEYS["single"])().labels[0].label == "bright", "the slot is back after cancellation"


# --------------------------------------------------------------------------- overload


def test_gateway_concurrency_limit_is_unavailable_at_once(stub, mesh):
    holders = _Holders(stub, mesh, KEYS["gold"], MAX_IN_FLIGHT)
    try:
        began = time.monotonic()
        got = status_of(_classify(stub, KEYS["gold"]))
        elapsed_s = time.monotonic() - began
    finally:
        holders.release()
    assert (got.code, got.message) == (
        grpc.StatusCode.UNAVAILABLE, f"gateway overloaded: {MAX_IN_FLIGHT} requests in flight (limit {MAX_IN_FLIGHT})"
    )
    assert got.pushback_ms == 50
    assert elapsed_s < 1.0, "refused at once, not queued behind the streams"


def test_sheddable_traffic_is_shed_first_with_a_retry_hint(stub, mesh):
    before = scrape(mesh.metrics_port).value("infermesh_gateway_shed_total",
                                             model="toy-classifier", priority="sheddable")
    holders = _Holders(stub, mesh, KEYS["gold"], 2)  # 2 of 4 slots: sheddable is shed from 50%
    try:
        shed = status_of(_classify(stub, KEYS["cheap"]))
        standard = _classify(stub, KEYS["silver"])()
    finally:
        holders.release()
    assert (shed.code, shed.message) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "overloaded: shedding sheddable traffic for model 'toy-classifier' (gateway concurrency 50% in use); "
        "retry after 0.10 s",
    )
    assert shed.retry_delay_s == 0.1 and shed.pushback_ms == 100
    assert standard.labels[0].label == "bright", "standard traffic is still admitted at this level"
    after = scrape(mesh.metrics_port).value("infermesh_gateway_shed_total",
                                            model="toy-classifier", priority="sheddable")
    assert after == before + 1


# --------------------------------------------------------------------------- deadlines


def test_deadline_below_the_models_minimum_service_time_is_refused_at_once(stub):
    # The classifier takes 200 ms per batch; once the scheduler has measured it and the gateway
    # has polled it, a 100 ms deadline cannot be met and is refused before any work.
    _classify(stub, KEYS["gold"])()

    def refused():
        try:
            got = status_of(_classify(stub, KEYS["gold"], timeout_s=0.1))
        except AssertionError:  # served in time: the estimate is not there yet
            return None
        return got if "deadline too short" in got.message else None

    wait_until(refused, timeout_s=10, interval_s=0.2, message="gateway learned the minimum service time")
    got = refused()
    assert got.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert got.message.startswith("deadline too short for model 'toy-classifier': ")
    head, _, tail = got.message.partition(" ms left, estimated minimum service time ")
    assert 50 < float(head.rsplit(" ", 1)[1]) <= 105  # the wire deadline may round up a little
    assert tail.endswith(" ms") and float(tail[:-3]) >= 150
