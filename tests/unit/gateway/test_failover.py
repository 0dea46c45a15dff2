"""Failover accounting with two schedulers: a dead one's whole load fails over outside the retry budget,
while retries against a live but struggling one stay capped by it. Streams resume as continuations."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from opentelemetry import trace

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import Internal, NotFound, ResourceExhausted, Unavailable
from services.common.metric_labels import OTHER as OTHER_LABEL
from services.gateway.dispatch.deadlines import DeadlinePolicy, Deadlines
from services.gateway.dispatch.dispatcher import (
    MAX_REGROUPS,
    NOT_SERVED_NOW_RETRY_S,
    REGROUP_BACKOFF_S,
    REGROUP_MAX_BACKOFF_S,
    Dispatcher,
)
from services.gateway.dispatch.retry_budget import RetryBudgetConfig, RetryBudgets
from services.gateway.dispatch.retry_policy import RetryPolicy, RetryPolicyConfig, WorkKind
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.replicas import Membership, ReplicaSelector, rendezvous_order
from services.gateway.routing.table import RoutingTable, parse_routing_config
from services.gateway.upstream.clients import AttemptError
from services.gateway.upstream.status import UpstreamCode
from tests.unit.gateway.conftest import FakeClients, FixedRng, make_dispatcher, make_scope

A, B = "10.0.0.1:50052", "10.0.0.2:50052"
MODEL = "tinylm"
PREFERRED = rendezvous_order(MODEL, [A, B])[0]
OTHER = B if PREFERRED == A else A
# 0.2 retries/s floor over 10 s and no ratio: 2 retries per window for the whole gateway's calls to one endpoint.
BUDGET = RetryBudgetConfig(retry_ratio=0.0, window_s=10, min_retries_per_s=0.2)


def _make(clock, breaker: BreakerConfig | None = None, max_resumes: int = 3, on_regroup=lambda: None):
    breakers = CircuitBreakers(breaker or BreakerConfig(num_consecutive_failures_to_open=1000,
                                                        min_calls_in_window=1000), clock)
    budgets = RetryBudgets(BUDGET, clock)
    sleeps: list[float] = []

    async def sleep(delay_s: float) -> None:
        sleeps.append(delay_s)
        clock.advance(delay_s)

    dispatcher = make_dispatcher(clock, breakers, budgets, (A, B), sleep=sleep, max_resumes=max_resumes,
                                 on_regroup=on_regroup)
    return SimpleNamespace(dispatcher=dispatcher, budgets=budgets, breakers=breakers, sleeps=sleeps)


def _scope(clock, timeout_s: float = 10.0):
    return make_scope(clock, MODEL, timeout_s)


def _gone() -> AttemptError:
    return AttemptError(Unavailable("scheduler stream broke: connection reset"), UpstreamCode.UNAVAILABLE, None)


def _draining() -> AttemptError:
    return AttemptError(Unavailable("scheduler draining: try another", retry_after_s=0.0), UpstreamCode.UNAVAILABLE, 0)


def _no_worker() -> AttemptError:
    return AttemptError(Unavailable("no worker serves model tinylm", retry_after_s=0.3), UpstreamCode.UNAVAILABLE, 300)


def _by_endpoint(failures: dict[str, AttemptError]):
    calls: list[str] = []

    async def call(client, version, timeout_s):
        calls.append(client)
        if client in failures:
            raise failures[client]
        return f"labels from {client}"

    return call, calls


@pytest.mark.parametrize("failure", [_gone, _draining], ids=["transport", "draining"])
async def test_a_dead_replicas_whole_load_fails_over_outside_the_budget(clock, failure):
    parts = _make(clock)
    died = asyncio.Event()
    calls: list[str] = []

    async def call(client, version, timeout_s):
        calls.append(client)
        if client == PREFERRED:
            await died.wait()  # 200 calls in flight on it when it dies
            raise failure()
        return f"labels from {client}"

    pending = [asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call))
               for _ in range(200)]
    await asyncio.sleep(0)
    assert calls == [PREFERRED] * 200
    died.set()
    results = await asyncio.gather(*pending)
    assert results == [f"labels from {OTHER}"] * 200, "every call succeeded on the live replica"
    assert calls.count(OTHER) == 200
    assert set(parts.sleeps) == {0.0}, "a failover goes at once"
    assert parts.budgets.for_upstream(PREFERRED).balance() == pytest.approx(2.0), "no retry was charged"


async def test_after_one_call_found_it_gone_later_calls_avoid_the_dead_replica(clock):
    parts = _make(clock)
    call, calls = _by_endpoint({PREFERRED: _gone()})
    for _ in range(50):
        assert await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call) == f"labels from {OTHER}"
    assert calls.count(PREFERRED) == 1, "until it answers a poll again, it is chosen only if nothing else is"


async def test_the_breaker_stops_calls_to_a_dead_replica_even_without_membership(clock):
    breakers = CircuitBreakers(BreakerConfig(num_consecutive_failures_to_open=5), clock)
    dispatcher = Dispatcher(
        routing=RoutingTable(parse_routing_config(
            {"models": {MODEL: {"default_version": "1", "endpoints": [A, B]}}}, "routing.yaml"), breakers,
            rng=FixedRng(0.0)),
        clients=FakeClients(), policy=RetryPolicy(RetryPolicyConfig(max_attempts=3), rng=FixedRng(0.5)),
        budgets=RetryBudgets(BUDGET, clock), breakers=breakers, deadlines=Deadlines(DeadlinePolicy(), clock),
        board=PressureBoard(clock),
    )
    call, calls = _by_endpoint({A: _gone()})
    for _ in range(50):
        assert await dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call) == f"labels from {B}"
    assert calls.count(A) == 5, "failovers stop costing anything once the breaker opened"


async def test_retries_against_a_live_struggling_replica_stay_capped_by_the_budget(clock):
    parts = _make(clock)
    call, calls = _by_endpoint({PREFERRED: _no_worker(), OTHER: _no_worker()})
    outcomes = []
    for _ in range(20):
        try:
            await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
        except Unavailable as exc:
            outcomes.append(exc.message)
    assert len(outcomes) == 20, "nobody can serve it: every call fails"
    num_retries = len(calls) - 20
    assert num_retries == 4, f"each endpoint's budget allows 2 retries over the window, made {num_retries}"
    assert all(parts.budgets.for_upstream(e).balance() < 1 for e in (A, B))


async def test_a_live_schedulers_refusal_is_not_failed_over(clock):
    parts = _make(clock)
    refusal = AttemptError(ResourceExhausted("queue full", retry_after_s=1.0), UpstreamCode.RESOURCE_EXHAUSTED, 1000)
    call, calls = _by_endpoint({PREFERRED: refusal})
    with pytest.raises(ResourceExhausted):
        await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
    assert calls == [PREFERRED]


async def test_failover_goes_to_each_endpoint_once_then_falls_back_to_budgeted_retries(clock):
    parts = _make(clock)
    call, calls = _by_endpoint({A: _gone(), B: _gone()})
    with pytest.raises(Unavailable):
        await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
    # 1 failover (free) to the other endpoint, then max_attempts=3 ends it after one budgeted retry;
    # no regroup rounds: no live scheduler said the state is transient, both are just unreachable.
    assert calls == [PREFERRED, OTHER, PREFERRED]
    assert parts.budgets.for_upstream(OTHER).balance() == pytest.approx(1.0)


async def test_a_roll_one_scheduler_unreachable_the_other_draining_is_retried_in_rounds(clock):
    parts = _make(clock)
    draining = AttemptError(Unavailable("scheduler draining: go elsewhere"), UpstreamCode.UNAVAILABLE, 0)
    call, calls = _by_endpoint({A: _gone(), B: draining})
    with pytest.raises(Unavailable):
        await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
    assert [d for d in parts.sleeps if d >= REGROUP_BACKOFF_S] == [0.1, 0.2, 0.4, 0.8]
    assert len(calls) <= 3 * (1 + MAX_REGROUPS)


async def test_a_roll_waits_out_rounds_where_every_breaker_is_open_for_the_restarted_scheduler(clock):
    # The roll that lost calls: the restarted scheduler's breaker opened on connects refused while its
    # channel reconnected; the other drained and exited. No endpoint may be called for a while: the
    # call waits for the next round, and the poll each round starts lets the restarted one back in.
    restarted = {"up": False}
    num_regroups = []

    def on_regroup() -> None:
        num_regroups.append(1)
        if len(num_regroups) == 3:  # the poll started by the third round finds it answering
            restarted["up"] = True
            parts.breakers.for_endpoint(PREFERRED).answered_poll()

    parts = _make(clock, BreakerConfig(num_consecutive_failures_to_open=1, open_cooldown_s=5), on_regroup=on_regroup)
    calls: list[str] = []

    async def call(client, version, timeout_s):
        calls.append(client)
        if client == PREFERRED:
            if not restarted["up"]:
                raise _gone()
            return "labels"
        raise _draining() if calls.count(OTHER) == 1 else _gone()

    assert await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call) == "labels"
    assert calls == [PREFERRED, OTHER, OTHER, PREFERRED]
    assert len(num_regroups) == 3
    assert [d for d in parts.sleeps if d >= REGROUP_BACKOFF_S] == [0.1, 0.2, 0.4]


async def test_rounds_with_every_breaker_open_end_with_the_last_error_within_the_regroup_limit(clock):
    parts = _make(clock, BreakerConfig(num_consecutive_failures_to_open=1, open_cooldown_s=5))
    calls: list[str] = []

    async def call(client, version, timeout_s):
        calls.append(client)
        raise _draining() if client == OTHER and calls.count(OTHER) == 1 else _gone()

    with pytest.raises(Unavailable, match="connection reset"):
        await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
    assert calls == [PREFERRED, OTHER, OTHER]
    assert [d for d in parts.sleeps if d >= REGROUP_BACKOFF_S] == [0.1, 0.2, 0.4, 0.8]


async def test_failover_stops_at_the_deadline(clock):
    parts = _make(clock)
    calls = []

    async def call(client, version, timeout_s):
        calls.append(client)
        clock.advance(timeout_s)  # the dead scheduler took the whole deadline to fail
        raise _gone()

    with pytest.raises(Unavailable, match="connection reset"):
        await parts.dispatcher.unary(_scope(clock, timeout_s=1.0), WorkKind.CLASSIFY, call)
    assert calls == [PREFERRED]


# -- stream resumption ------------------------------------------------------------------


def _chunk(index: int, *token_ids: int, version: str = "", final: bool = False) -> gateway_pb2.GenerateResponse:
    chunk = gateway_pb2.GenerateResponse(token_ids=token_ids, index=index, text="".join(chr(96 + t) for t in token_ids))
    chunk.model.version = version
    if final:
        chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
        chunk.usage.prompt_tokens = 4
        chunk.usage.completion_tokens = index + len(token_ids)
    return chunk


class ScriptedStream:
    def __init__(self, chunks, error: AttemptError | None = None) -> None:
        self._chunks, self._error = chunks, error
        self.cancelled = False

    async def chunks(self):
        for chunk in self._chunks:
            yield chunk
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self.cancelled = True


def _streams(*streams):
    attempts: list[tuple[str, str, tuple[int, ...]]] = []
    queue = list(streams)

    def call(client, version, timeout_s, continuation):
        attempts.append((client, version, continuation))
        return queue.pop(0)

    return call, attempts


async def _collect(parts, scope, call):
    return [c async for c in parts.dispatcher.stream(scope, call, lambda c: None)]


async def test_a_broken_stream_resumes_on_the_other_replica_as_one_unbroken_stream(clock):
    parts = _make(clock)
    call, attempts = _streams(
        ScriptedStream([_chunk(0, 1, 2, version="3"), _chunk(2, 3)], _gone()),
        ScriptedStream([_chunk(3, 4), _chunk(4, 5, version="3", final=True)]),
    )
    chunks = await _collect(parts, _scope(clock), call)
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5]
    assert [c.index for c in chunks] == [0, 2, 3, 4]
    assert attempts == [(PREFERRED, "", ()), (OTHER, "3", (1, 2, 3))], "same version, every delivered token"
    assert [c.finish_reason != 0 for c in chunks].count(True) == 1
    assert chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("cut", [
    ScriptedStream([_chunk(0, 1)]),  # ended with no final chunk and no status
    ScriptedStream([_chunk(0, 1)], _draining()),
])
async def test_a_cut_or_handed_over_stream_resumes(clock, cut):
    parts = _make(clock)
    call, attempts = _streams(cut, ScriptedStream([_chunk(1, 2, final=True)]))
    chunks = await _collect(parts, _scope(clock), call)
    assert [t for c in chunks for t in c.token_ids] == [1, 2]
    assert attempts[1][2] == (1,)


async def test_a_resumed_scheduler_that_undercounts_usage_is_corrected(clock):
    parts = _make(clock)
    final = _chunk(1, 2, final=True)
    final.usage.completion_tokens = 1  # it counted only what it generated itself
    call, _ = _streams(ScriptedStream([_chunk(0, 1)], _gone()), ScriptedStream([final]))
    chunks = await _collect(parts, _scope(clock), call)
    assert chunks[-1].usage.completion_tokens == 2


async def test_resumes_are_capped_per_stream(clock):
    parts = _make(clock, max_resumes=3)
    streams = [ScriptedStream([_chunk(i, 10 + i)], _gone()) for i in range(5)]
    call, attempts = _streams(*streams)
    delivered = []
    with pytest.raises(Unavailable):
        async for chunk in parts.dispatcher.stream(_scope(clock), call, lambda c: None):
            delivered.extend(chunk.token_ids)
    assert len(attempts) == 4, "the first attempt and 3 resumes"
    assert delivered == [10, 11, 12, 13]
    assert attempts[-1][2] == (10, 11, 12)


async def test_a_resume_that_would_repeat_or_skip_tokens_fails_the_stream(clock):
    parts = _make(clock)
    repeat = ScriptedStream([_chunk(0, 1, 2, final=True)])  # a scheduler ignoring the continuation
    call, _ = _streams(ScriptedStream([_chunk(0, 1)], _gone()), repeat)
    delivered = []
    with pytest.raises(Internal, match="chunk at index 0 does not continue the 1 tokens delivered"):
        async for chunk in parts.dispatcher.stream(_scope(clock), call, lambda c: None):
            delivered.extend(chunk.token_ids)
    assert delivered == [1] and repeat.cancelled


async def test_no_resume_after_the_deadline(clock):
    parts = _make(clock)
    call, attempts = _streams(ScriptedStream([_chunk(0, 1)], _gone()), ScriptedStream([_chunk(1, 2, final=True)]))
    scope = _scope(clock, timeout_s=1.0)
    with pytest.raises(Unavailable):
        async for _ in parts.dispatcher.stream(scope, call, lambda c: None):
            clock.advance(2.0)
    assert len(attempts) == 1


async def test_a_resumed_attempt_is_a_resume_child_span_of_the_request(clock, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from services.gateway.dispatch import dispatcher as dispatch

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(dispatch, "_tracer", tracer)
    parts = _make(clock)
    call, _ = _streams(ScriptedStream([_chunk(0, 1, 2)], _gone()), ScriptedStream([_chunk(2, 3, final=True)]))
    with tracer.start_as_current_span("gateway.Generate") as request_span:
        await _collect(parts, _scope(clock), call)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"gateway.Generate", "attempt", "resume"}
    request_id = request_span.get_span_context().span_id
    assert spans["attempt"].parent.span_id == request_id and spans["resume"].parent.span_id == request_id
    assert spans["resume"].attributes["infermesh.tokens_delivered"] == 2
    assert spans["resume"].attributes["infermesh.endpoint"] == OTHER
    # Upstream attempts are CLIENT spans with the RPC conventions (service graphs: gateway -> scheduler).
    for name in ("attempt", "resume"):
        assert spans[name].kind is trace.SpanKind.CLIENT
        assert spans[name].attributes["rpc.service"] == "infermesh.v1.Scheduler"
        assert spans[name].attributes["rpc.method"] == "Generate"
    assert spans["resume"].attributes["server.address"] == OTHER.rpartition(":")[0]


async def test_a_scheduler_not_serving_the_model_is_failed_over_and_skipped_until_its_next_poll(clock):
    membership = Membership(lambda: (A, B))
    membership.update(A, [MODEL])
    membership.update(B, [MODEL])
    parts = _make(clock)
    parts.dispatcher._routing = RoutingTable((), parts.breakers, replicas=ReplicaSelector(membership))
    not_served = AttemptError(NotFound(f"model '{MODEL}' is not served here"), UpstreamCode.NOT_FOUND, None)
    call, calls = _by_endpoint({PREFERRED: not_served})
    assert await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call) == f"labels from {OTHER}"
    assert await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call) == f"labels from {OTHER}"
    assert calls == [PREFERRED, OTHER, OTHER], "the restarted scheduler is skipped after its first NOT_FOUND"
    assert parts.budgets.for_upstream(PREFERRED).balance() == pytest.approx(2.0), "no retry was charged"
    membership.update(PREFERRED, [MODEL])  # its workers re-attached: the next poll says so
    assert membership.candidates(MODEL) == (A, B)


async def test_nobody_serving_a_known_model_ends_in_unavailable_with_a_hint_after_a_few_rounds(clock):
    # Its workers may be moving (a scheduler rolled, or hung while they re-attach): every round asks
    # each scheduler once. The model exists, so the caller is told to retry, not that it is unknown.
    parts = _make(clock)
    not_served = AttemptError(NotFound(f"model '{MODEL}' is not served here"), UpstreamCode.NOT_FOUND, None)
    call, calls = _by_endpoint({A: not_served, B: not_served})
    with pytest.raises(Unavailable, match=f"no scheduler serves model '{MODEL}' right now") as info:
        await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
    assert info.value.retry_after_s == NOT_SERVED_NOW_RETRY_S
    assert sorted(calls) == sorted([A, B] * (1 + MAX_REGROUPS))
    assert [d for d in parts.sleeps if d > 0] == [0.1, 0.2, 0.4, 0.8]


async def test_a_stream_whose_resume_finds_its_model_served_nowhere_ends_unavailable(clock):
    parts = _make(clock, max_resumes=2)
    not_served = AttemptError(NotFound(f"model '{MODEL}:1' is not served here"), UpstreamCode.NOT_FOUND, None)
    call, _ = _streams(ScriptedStream([_chunk(0, 1, version="1")], _gone()),
                       *(ScriptedStream([], not_served) for _ in range(8)))
    delivered = []
    with pytest.raises(Unavailable, match="right now"):
        async for chunk in parts.dispatcher.stream(_scope(clock), call, lambda c: None):
            delivered.extend(chunk.token_ids)
    assert delivered == [1]


async def test_a_made_up_model_gets_not_found_after_each_endpoint_once(clock):
    parts = _make(clock)
    not_served = AttemptError(NotFound("model 'nope' is not served here"), UpstreamCode.NOT_FOUND, None)
    call, calls = _by_endpoint({A: not_served, B: not_served})
    scope = _scope(clock)
    scope.metric_model = OTHER_LABEL  # the gateway knows no such model: no rounds
    with pytest.raises(NotFound):
        await parts.dispatcher.unary(scope, WorkKind.CLASSIFY, call)
    assert sorted(calls) == [A, B]


async def test_a_version_nobody_ever_served_gets_its_not_found_without_rounds(clock):
    # Rounds for a made-up version held the model's concurrency slots for ~1.5 s a request.
    parts = _make(clock)
    not_served = AttemptError(NotFound(f"model '{MODEL}:v9' is not served here"), UpstreamCode.NOT_FOUND, None)
    call, calls = _by_endpoint({A: not_served, B: not_served})
    scope = _scope(clock)
    scope.version, scope.metric_version = "v9", OTHER_LABEL
    with pytest.raises(NotFound):
        await parts.dispatcher.unary(scope, WorkKind.CLASSIFY, call)
    assert sorted(calls) == [A, B] and [d for d in parts.sleeps if d > 0] == []
    # A version the gateway has seen gets its rounds, as a known model does.
    known = AttemptError(NotFound(f"model '{MODEL}:2' is not served here"), UpstreamCode.NOT_FOUND, None)
    outcomes = iter([known, known])

    async def moved(client, version, timeout_s):
        failure = next(outcomes, None)
        if failure is not None:
            raise failure
        return "answer"

    scope.version, scope.metric_version = "2", "2"
    assert await parts.dispatcher.unary(scope, WorkKind.CLASSIFY, moved) == "answer"


async def test_a_model_whose_workers_moved_is_served_in_the_next_round(clock):
    parts = _make(clock)
    not_served = AttemptError(NotFound(f"model '{MODEL}' is not served here"), UpstreamCode.NOT_FOUND, None)
    outcomes = iter([not_served, not_served])
    calls = []

    async def call(client, version, timeout_s):
        calls.append(client)
        failure = next(outcomes, None)
        if failure is not None:
            raise failure
        return "answer"

    assert await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call) == "answer"
    assert len(calls) == 3 and [d for d in parts.sleeps if d > 0] == [0.1]


async def test_a_resume_that_meets_a_scheduler_not_serving_the_model_resumes_again(clock):
    parts = _make(clock)
    not_served = AttemptError(NotFound(f"model '{MODEL}' is not served here"), UpstreamCode.NOT_FOUND, None)
    call, attempts = _streams(ScriptedStream([_chunk(0, 1)], _gone()), ScriptedStream([], not_served),
                              ScriptedStream([_chunk(1, 2, final=True)]))
    chunks = await _collect(parts, _scope(clock), call)
    assert [t for c in chunks for t in c.token_ids] == [1, 2]
    assert [a[2] for a in attempts] == [(), (1,), (1,)]


# -- calls severed off a scheduler that stopped answering (issue 35) -----------------------------


def _silent() -> AttemptError:
    return AttemptError.local(UpstreamCode.UNAVAILABLE, "scheduler stopped answering", scheduler_silent=True)


def _hung_preferred_restarting_other(clock, deadline_s: float, serving_after_rounds: int):
    """PREFERRED hangs with 50 classify calls in flight (the silence watch severs them); OTHER was just
    restarted and serves the model only after `serving_after_rounds` regroup rounds (its workers
    re-attaching, the round's poll seeing them); until then it answers "not served here"."""
    membership = Membership(lambda: (A, B))
    membership.update(PREFERRED, [MODEL])
    membership.update(OTHER, [])
    rounds = []
    not_served = AttemptError(NotFound(f"model '{MODEL}' is not served here"), UpstreamCode.NOT_FOUND, None)

    def on_regroup() -> None:
        rounds.append(1)
        if len(rounds) == serving_after_rounds:
            membership.update(OTHER, [MODEL])

    parts = _make(clock, on_regroup=on_regroup)
    parts.dispatcher._routing = RoutingTable((), parts.breakers, replicas=ReplicaSelector(membership))
    hung = asyncio.Event()
    calls: list[str] = []

    async def call(client, version, timeout_s):
        calls.append(client)
        if client == PREFERRED:
            await hung.wait()
            raise _silent()
        if not membership.serves(OTHER, MODEL):
            raise not_served
        return f"labels from {client}"

    pending = [asyncio.ensure_future(parts.dispatcher.unary(_scope(clock, deadline_s), WorkKind.CLASSIFY, call))
               for _ in range(50)]
    return parts, hung, calls, pending, rounds


def _redispatched() -> float:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("infermesh_gateway_redispatches_total",
                                     {"model": MODEL, "cause": "scheduler_silent"}) or 0.0


async def test_calls_severed_off_a_hung_scheduler_wait_for_the_restarted_one_and_all_succeed(clock):
    before = _redispatched()
    # Seven rounds: 0.1 + 0.2 + 0.4 + 0.8 x 4 = 3.9 s, past the four rounds (1.5 s) other calls get.
    parts, hung, calls, pending, rounds = _hung_preferred_restarting_other(clock, 6.0, serving_after_rounds=7)
    await asyncio.sleep(0)
    assert calls == [PREFERRED] * 50
    hung.set()
    results = await asyncio.gather(*pending)
    assert results == [f"labels from {OTHER}"] * 50, "nothing failed that could still succeed"
    assert max(parts.sleeps) == REGROUP_MAX_BACKOFF_S
    assert _redispatched() - before == 50, "each re-sent call counted once, apart from new calls"
    budget = parts.budgets.for_upstream(PREFERRED)
    assert budget.balance() >= 0, "budgeted retries stayed within the budget (the rest waited in rounds)"


async def test_a_severed_call_with_no_time_left_for_a_round_fails_unavailable(clock):
    parts, hung, calls, pending, _ = _hung_preferred_restarting_other(clock, 3.0, serving_after_rounds=99)
    await asyncio.sleep(0)
    clock.advance(2.95)  # the hang ate the deadline: no round fits before it
    hung.set()
    results = await asyncio.gather(*pending, return_exceptions=True)
    assert all(isinstance(r, Unavailable) for r in results)
    assert [d for d in parts.sleeps if d >= REGROUP_BACKOFF_S] == [], "no round fits: failed at once"


async def test_a_plain_unreachable_scheduler_still_gets_no_rounds(clock):
    """Without a live scheduler's word or the silence watch's verdict, an unreachable replica set stays
    with the budget and the breakers (no storm of rounds)."""
    membership = Membership(lambda: (A, B))
    membership.update(PREFERRED, [MODEL])
    parts = _make(clock)
    parts.dispatcher._routing = RoutingTable((), parts.breakers, replicas=ReplicaSelector(membership))
    call, calls = _by_endpoint({PREFERRED: _gone(), OTHER: _gone()})
    with pytest.raises(Unavailable, match="connection reset"):
        await parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)
    assert [d for d in parts.sleeps if d >= REGROUP_BACKOFF_S] == []
