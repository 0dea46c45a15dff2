"""The shadow mirror with fake schedulers: it compares outputs, never touches the client's answer,
stays within its budget, is shed first, and feeds the canary's rollout window."""

from __future__ import annotations

import asyncio

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.priority import Priority
from services.gateway.rollout.controller import RolloutController
from services.gateway.rollout.shadow import ShadowMirror, labels_agree, tokens_agree
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.table import RoutingTable, parse_routing_config
from services.gateway.upstream.clients import AttemptError
from services.gateway.upstream.status import UpstreamCode

SPEC = {"models": {"digits": {"default_version": "1", "endpoints": ["127.0.0.1:1"], "versions": {"2": {}},
                              "rollout": {"canary_version": "2", "steps": ["shadow", 100], "min_requests": 5,
                                          "min_duration_s": 0, "shadow_max_in_flight": 2}}}}
IMAGE = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(4), height=2, width=2, channels=1))


def label(name: str, score: float = 1.0) -> common_pb2.Label:
    return common_pb2.Label(label=name, score=score)


SEVEN = (label("seven"),)


class FakeCall:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.cancelled = tokens, False

    async def chunks(self):
        for i, token in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            yield gateway_pb2.GenerateResponse(
                token_ids=[token], finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)

    def cancel(self) -> None:
        self.cancelled = True


class FakeScheduler:
    """Answers classify with `labels` after `gate` opens (or fails with `fail`); records what it got."""

    def __init__(self, labels=SEVEN, tokens=(1, 2, 3), fail: UpstreamCode | None = None) -> None:
        self.labels, self.tokens, self.fail = list(labels), list(tokens), fail
        self.gate = asyncio.Event()
        self.gate.set()
        self.requests: list = []
        self.calls: list[FakeCall] = []

    def get(self, address: str) -> FakeScheduler:
        return self

    async def classify(self, request, timeout_s: float):
        self.requests.append(request)
        await self.gate.wait()
        if self.fail is not None:
            raise AttemptError.local(self.fail, "boom")
        return gateway_pb2.ClassifyResponse(labels=self.labels)

    def generate(self, request, timeout_s: float) -> FakeCall:
        self.requests.append(request)
        self.calls.append(FakeCall(self.tokens))
        return self.calls[-1]


def make(scheduler: FakeScheduler, clock, *, admits: bool = True):
    routes = parse_routing_config(SPEC, "routing.yaml")
    routing = RoutingTable(routes, CircuitBreakers(BreakerConfig(), clock))
    rollouts = RolloutController(routing, clock=clock)
    rollouts.apply_routes(routes)
    mirror = ShadowMirror(rollouts, routing, scheduler, admits_sheddable=lambda model: admits, timeout_s=1.0,
                          max_score_drift=rollouts.max_score_drift, rng=lambda: 0.0, clock=clock)
    return mirror, rollouts


def classify(mirror: ShadowMirror, version: str = "", answer=SEVEN) -> None:
    request = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="digits", version=version), image=IMAGE)
    mirror.classify("digits", request, gateway_pb2.ClassifyResponse(labels=list(answer)), "acme")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_comparisons():
    assert labels_agree([label("a", 0.9)], [label("a", 0.88)], 0.05)
    assert not labels_agree([label("a", 0.9)], [label("a", 0.7)], 0.05)
    assert not labels_agree([label("a")], [label("b")], 0.05)
    assert tokens_agree([1, 2, 3], [1, 2, 3]) == (True, 3)
    assert tokens_agree([1, 2, 3], [1, 9, 3]) == (False, 1)
    assert tokens_agree([1, 2], [1, 2, 3]) == (False, 2)


async def test_mirrors_to_the_candidate_as_sheddable_and_records_agreement(clock):
    scheduler = FakeScheduler(labels=[label("three")])
    mirror, rollouts = make(scheduler, clock)
    classify(mirror)
    await settle()
    (sent,) = scheduler.requests
    assert sent.request.model.version == "2"
    assert sent.tenant.priority == int(Priority.SHEDDABLE) and sent.tenant.tenant_id == "acme"
    view = rollouts.views()[0]
    assert view.num_canary == 1
    assert rollouts._rollouts["digits"].canary.num_agreed == 0, "three is not seven"


async def test_a_request_naming_a_version_is_not_mirrored(clock):
    scheduler = FakeScheduler()
    mirror, _ = make(scheduler, clock)
    classify(mirror, version="1")
    await settle()
    assert scheduler.requests == []


async def test_the_budget_caps_mirrored_calls_in_flight_and_shedding_stops_them(clock):
    scheduler = FakeScheduler()
    scheduler.gate.clear()
    mirror, _ = make(scheduler, clock)
    for _ in range(5):
        classify(mirror)
    await settle()
    assert len(scheduler.requests) == 2, "shadow_max_in_flight: 2"
    scheduler.gate.set()
    await settle()
    classify(mirror)
    await settle()
    assert len(scheduler.requests) == 3, "the budget frees as calls finish"
    shed_scheduler = FakeScheduler()
    shed_mirror, _ = make(shed_scheduler, clock, admits=False)
    classify(shed_mirror)
    await settle()
    assert shed_scheduler.requests == [], "not sent while sheddable traffic is shed"


async def test_a_failing_shadow_is_counted_as_the_canarys_error_only(clock):
    scheduler = FakeScheduler(fail=UpstreamCode.INTERNAL)
    mirror, rollouts = make(scheduler, clock)
    classify(mirror)
    await settle()
    window = rollouts._rollouts["digits"].canary
    assert (window.num_requests, window.num_errors, window.num_compared) == (1, 1, 0)


async def test_greedy_generate_streams_are_compared_token_by_token(clock):
    scheduler = FakeScheduler(tokens=[5, 6, 7])
    mirror, rollouts = make(scheduler, clock)
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="digits"), prompt="hi")
    mirror.generate("digits", request, [5, 6, 7], "acme")
    mirror.generate("digits", request, [5, 9, 7], "acme")
    await settle()
    window = rollouts._rollouts["digits"].canary
    assert (window.num_compared, window.num_agreed) == (2, 1)
    assert all(call.cancelled for call in scheduler.calls), "streams are closed, diverged or not"
    await mirror.close()
