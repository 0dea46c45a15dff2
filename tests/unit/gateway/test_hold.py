"""The hold (dispatch/hold.py): while no scheduler can take a call, idempotent calls and resumable
streams wait for one within their deadline, capped, cancellable, and streams resume exactly.

A fake clock drives everything: `_drive` moves it in small steps, and when it passes the outage's
end it does what the pressure poller does then (the breakers hear the endpoints answer, the hold is
woken)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from services.common.errors import DeadlineExceeded, Unavailable
from services.common.priority import Priority
from services.gateway.admission.adaptive_limit import AdaptiveLimit, AdaptiveLimitConfig, Outcome
from services.gateway.dispatch.hold import HOLD_BACKOFF_S, CallHold
from services.gateway.dispatch.retry_budget import RetryBudgetConfig, RetryBudgets
from services.gateway.dispatch.retry_policy import WorkKind
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.telemetry import metrics
from services.gateway.upstream.clients import AttemptError
from services.gateway.upstream.status import UpstreamCode
from tests.unit.gateway.conftest import make_dispatcher, make_scope
from tests.unit.gateway.test_failover import ScriptedStream, _chunk

A, B = "10.0.0.1:50052", "10.0.0.2:50052"
MODEL = "heldmodel"
STEP_S = 0.05


def _make(clock, max_held: int = 64, max_resumes: int = 3):
    breakers = CircuitBreakers(BreakerConfig(), clock)  # opens after 5 failures in a row, 5 s cool-down
    budgets = RetryBudgets(RetryBudgetConfig(retry_ratio=0.1, window_s=10, min_retries_per_s=1.0), clock)

    async def wait(event: asyncio.Event, timeout_s: float) -> bool:
        timer = asyncio.ensure_future(clock.sleep(timeout_s))
        woken = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({timer, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            timer.cancel()
            woken.cancel()
        return event.is_set()

    hold = CallHold(max_held, wait=wait, sleep=clock.sleep)
    dispatcher = make_dispatcher(clock, breakers, budgets, (A, B), sleep=clock.sleep, max_resumes=max_resumes,
                                 hold=hold)
    return SimpleNamespace(dispatcher=dispatcher, breakers=breakers, budgets=budgets, hold=hold)


def _scope(clock, timeout_s: float = 10.0):
    return make_scope(clock, MODEL, timeout_s)


def _gone() -> AttemptError:
    return AttemptError(Unavailable("scheduler stream broke: connection refused"), UpstreamCode.UNAVAILABLE, None)


def _no_worker() -> AttemptError:
    return AttemptError(Unavailable("no worker serves model", retry_after_s=0.3), UpstreamCode.UNAVAILABLE, 300)


async def _drive(clock, parts, tasks, *, back_at_s: float, limit_s: float = 60.0) -> None:
    """Moves the fake clock until every task is done; at back_at_s the schedulers answer polls again,
    with the model ready."""
    announced = False
    start_s = clock()
    while not all(t.done() for t in tasks):
        assert clock() - start_s < limit_s, "the calls never finished"
        await asyncio.sleep(0)
        clock.advance(STEP_S)
        if not announced and clock() >= back_at_s:
            announced = True
            for endpoint in (A, B):  # what PressurePoller.poll_endpoint does with an answer
                parts.breakers.for_endpoint(endpoint).answered_poll()
            parts.hold.wake((MODEL,))
        for _ in range(5):
            await asyncio.sleep(0)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def _held(result: str = "held") -> float:
    return _sample("infermesh_gateway_held_calls_total", result=result)


def _held_now() -> float:
    return _sample("infermesh_gateway_held_requests")


def _unary_down_until(clock, back_at_s: float, calls: list[float] | None = None):
    async def call(client, version, timeout_s):
        if calls is not None:
            calls.append(clock())
        if clock() < back_at_s:
            raise _gone()
        return f"labels from {client}"

    return call


async def test_calls_finding_every_scheduler_gone_are_held_and_all_succeed_once_one_is_back(clock):
    parts = _make(clock)
    held, redispatched = _held(), _sample("infermesh_gateway_redispatches_total", cause="held")
    back_at_s = clock() + 3.0
    tasks = [asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY,
                                                          _unary_down_until(clock, back_at_s)))
             for _ in range(20)]
    await _drive(clock, parts, tasks, back_at_s=back_at_s)
    assert [t.result() for t in tasks].count(f"labels from {A}") + [t.result() for t in tasks].count(
        f"labels from {B}") == 20, "nothing failed that could still succeed"
    assert clock() - back_at_s <= max(HOLD_BACKOFF_S) + 2 * STEP_S, "re-dispatched once a scheduler answered"
    assert _held() - held == 20, "each held call counted once"
    assert _sample("infermesh_gateway_redispatches_total", cause="held") - redispatched == 20
    assert parts.hold.num_held == 0 and _held_now() == 0


async def test_a_held_call_whose_deadline_ends_first_fails_deadline_exceeded_saying_so(clock):
    parts = _make(clock)
    back_at_s = clock() + 5.0
    calls: list[float] = []
    task = asyncio.ensure_future(parts.dispatcher.unary(_scope(clock, timeout_s=3.0), WorkKind.CLASSIFY,
                                                        _unary_down_until(clock, back_at_s, calls)))
    await _drive(clock, parts, [task], back_at_s=back_at_s)
    with pytest.raises(DeadlineExceeded, match=r"deadline exceeded while held: no scheduler could take the call "
                                               r"for 2\.\d s"):
        task.result()
    assert clock() < back_at_s, "failed when its time was up, not when the schedulers came back"
    assert parts.hold.num_held == 0
    held_at_s = calls[-1]
    assert all(t <= held_at_s for t in calls) and len(calls) <= 4, (
        "while no scheduler answered, the hold sent nothing more: the attempts before it, within the budget")


async def test_a_wake_for_another_model_leaves_the_held_call_waiting(clock):
    parts = _make(clock)
    for endpoint in (A, B):  # every breaker open: the call is held before any attempt
        for _ in range(parts.breakers.config.num_consecutive_failures_to_open):
            parts.breakers.for_endpoint(endpoint).try_acquire().failure()
    task = asyncio.ensure_future(parts.dispatcher.unary(_scope(clock, timeout_s=3.0), WorkKind.CLASSIFY,
                                                        _unary_down_until(clock, clock())))
    for _ in range(10):
        await asyncio.sleep(0)
    assert parts.hold.num_held == 1
    parts.hold.wake(("another-model",))
    for _ in range(10):
        await asyncio.sleep(0)
    assert not task.done() and parts.hold.num_held == 1
    for endpoint in (A, B):
        parts.breakers.for_endpoint(endpoint).answered_poll()
    parts.hold.wake((MODEL,))
    assert (await task).startswith("labels from ")


async def test_beyond_the_cap_a_call_is_refused_at_once_saying_the_hold_is_full(clock):
    parts = _make(clock, max_held=2)
    refused = _held("refused")
    back_at_s = clock() + 3.0
    call = _unary_down_until(clock, back_at_s)
    first = [asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call)) for _ in range(2)]
    while parts.hold.num_held < 2:
        await asyncio.sleep(0)
        clock.advance(STEP_S)
    third = asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call))
    await _drive(clock, parts, [*first, third], back_at_s=back_at_s)
    with pytest.raises(Unavailable, match=r"not held: 2 calls already wait for a scheduler"):
        third.result()
    assert [t.result() for t in first] == [first[0].result()] * 2
    assert _held("refused") - refused == 1


async def test_a_client_cancelling_a_held_call_frees_its_place_at_once(clock):
    parts = _make(clock)
    calls: list[float] = []
    task = asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY,
                                                        _unary_down_until(clock, clock() + 100, calls)))
    while parts.hold.num_held == 0:
        await asyncio.sleep(0)
        clock.advance(STEP_S)
    assert _held_now() == 1
    num_calls = len(calls)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert parts.hold.num_held == 0 and _held_now() == 0, "its place is free at once"
    clock.advance(10)
    await asyncio.sleep(0)
    assert len(calls) == num_calls, "nothing more was sent for it"


async def test_a_live_schedulers_refusal_is_not_held(clock):
    parts = _make(clock)
    held = _held()

    async def call(client, version, timeout_s):
        raise _no_worker()

    task = asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY, call))
    await _drive(clock, parts, [task], back_at_s=clock() + 100)
    with pytest.raises(Unavailable, match="no worker"):
        task.result()
    assert _held() == held, "a live scheduler's answer stays with the retry budget"


async def test_nothing_is_held_with_the_hold_off(clock):
    parts = _make(clock, max_held=0)
    task = asyncio.ensure_future(parts.dispatcher.unary(_scope(clock), WorkKind.CLASSIFY,
                                                        _unary_down_until(clock, clock() + 100)))
    await _drive(clock, parts, [task], back_at_s=clock() + 100)
    with pytest.raises(Unavailable, match="connection refused|circuit open"):
        task.result()


async def test_a_stream_held_mid_way_resumes_exactly_and_the_wait_costs_no_resume(clock):
    parts = _make(clock, max_resumes=1)  # one break: the attempts nobody took must not count
    resumes = _sample("infermesh_gateway_stream_resumes_total", reason="unavailable")
    back_at_s = clock() + 3.0
    continuations: list[tuple[int, ...]] = []

    def call(client, version, timeout_s, continuation):
        continuations.append(continuation)
        if not continuation:
            return ScriptedStream([_chunk(0, 1, 2, version="1"), _chunk(2, 3)], _gone())
        if clock() < back_at_s:
            return ScriptedStream([], _gone())  # connection refused: nobody takes the resume
        return ScriptedStream([_chunk(3, 4), _chunk(4, 5, version="1", final=True)])

    async def collect():
        return [c async for c in parts.dispatcher.stream(_scope(clock), call, lambda c: None)]

    task = asyncio.ensure_future(collect())
    await _drive(clock, parts, [task], back_at_s=back_at_s)
    chunks = task.result()
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5], "no token lost or repeated"
    assert [c.index for c in chunks] == [0, 2, 3, 4]
    assert continuations[-1] == (1, 2, 3) and len(continuations) > 2
    assert _sample("infermesh_gateway_stream_resumes_total", reason="unavailable") - resumes == 1
    assert parts.hold.num_held == 0


# -- the model's adaptive limit around the hold (admission/adaptive_limit.py, "Held calls") --------------


def _limited_scope(clock, limit: AdaptiveLimit, timeout_s: float = 10.0):
    scope = _scope(clock, timeout_s)
    scope.model_permit = limit.acquire(Priority.CRITICAL, timeout_s)
    return scope


async def test_held_calls_leave_the_limit_for_good_and_their_wait_is_no_latency_sample(clock):
    parts = _make(clock)
    limit = AdaptiveLimit(MODEL, AdaptiveLimitConfig(initial_limit=20, min_limit=2, min_window_samples=20,
                                                     min_window_s=0.001), clock)
    back_at_s = clock() + 3.0
    served_s = 0.02

    async def call(client, version, timeout_s):
        if clock() < back_at_s:
            raise _gone()
        await clock.sleep(served_s)
        return "labels"

    scopes = [_limited_scope(clock, limit) for _ in range(20)]
    metrics.observe_model_in_flight(MODEL, limit.num_in_flight)  # as admission does
    tasks = [asyncio.ensure_future(parts.dispatcher.unary(scope, WorkKind.CLASSIFY, call)) for scope in scopes]
    while parts.hold.num_held < 20:
        await asyncio.sleep(0)
        clock.advance(STEP_S)
    assert limit.num_in_flight == 0, "held calls give their slots back; the hold's cap bounds them"
    assert _sample("infermesh_gateway_model_in_flight_requests") == 0
    new = limit.acquire(Priority.CRITICAL, 10.0)  # the model's limit is free for calls that can go
    new.done(Outcome.IGNORED)
    await _drive(clock, parts, tasks, back_at_s=back_at_s)
    assert [t.result() for t in tasks] == ["labels"] * 20
    assert limit.num_in_flight == 0, (
        "sent again, the burst stays out of the limit (the hold's cap bounds it): new calls are not refused")
    assert _sample("infermesh_gateway_model_in_flight_requests") == 0
    for scope in scopes:  # what RequestScope.finish does with an OK
        scope.model_permit.done(Outcome.SUCCESS)
    assert limit.num_in_flight == 0
    assert limit.recent_s is not None and limit.recent_s < 0.2, (
        f"the sample is the served attempt ({served_s} s and the fake clock's steps), not 3 s of hold: "
        f"{limit.recent_s}")
    assert limit.limit >= 20


async def test_a_call_whose_deadline_ran_out_in_the_hold_is_no_congestion_signal(clock):
    parts = _make(clock)
    limit = AdaptiveLimit(MODEL, AdaptiveLimitConfig(initial_limit=20, min_limit=2, min_window_samples=20,
                                                     min_window_s=0.001), clock)
    scopes = [_limited_scope(clock, limit, timeout_s=2.0) for _ in range(20)]
    tasks = [asyncio.ensure_future(parts.dispatcher.unary(scope, WorkKind.CLASSIFY,
                                                          _unary_down_until(clock, clock() + 100)))
             for scope in scopes]
    await _drive(clock, parts, tasks, back_at_s=clock() + 100)
    for task, scope in zip(tasks, scopes, strict=True):
        with pytest.raises(DeadlineExceeded):
            task.result()
        scope.model_permit.done(Outcome.DROPPED)  # RequestScope.finish maps DEADLINE_EXCEEDED so
    assert limit.limit == 20 and limit.recent_s is None, "no scheduler was there to be congested"
    assert limit.num_in_flight == 0
