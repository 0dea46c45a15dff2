"""Attempts: route, call the scheduler, and retry what the policy and the budget allow.

Each attempt takes a route (an endpoint whose circuit breaker admits the call),
calls it with the deadline's remaining time minus the hop margin, and reports
the outcome to that endpoint's breaker. A failure goes to the retry policy,
which pays for a retry from the failed endpoint's budget, or fails over free of
it when the endpoint is gone and another is untried (retry_policy.py); the next
attempt prefers an endpoint not tried yet. A Generate stream that already sent
tokens to the client is never retried: it is resumed as a continuation
(stream_resume.py), in a "resume" span, on the version that served it.

A call severed off a scheduler that stopped answering (AttemptError.scheduler_silent,
routing/silence_watch.py) is re-dispatched while its deadline allows: failed over at
once when another scheduler serves the model, else in regroup rounds (the other
scheduler may have just restarted, its workers re-attaching within about a second).
Issue 35: with one scheduler restarting and the other hung, 378 of 3930 classify
calls failed with 2 s of deadline left, for want of somewhere to go *at that moment*.

When no scheduler can take a call at all (every circuit open, every one gone, restarting or not
serving the model, and no regroup round left), an idempotent call or a resumable stream is held
(hold.py) and sent again as soon as one can, while its deadline allows; a stream keeps the tokens
it delivered and resumes from them. A resume that no scheduler took is held, not counted as
another resume. Only such failures are held: a live scheduler's refusal stays with the budget.
The model's adaptive limit hears of it (ModelSlot): time in which no scheduler could take the call
is no latency sample, and a held call gives its slot back when it is first held, for good: the
hold's cap bounds held calls and their burst when a scheduler returns (adaptive_limit.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from opentelemetry import trace

from services.common.errors import DeadlineExceeded, InfermeshError, Internal, NotFound, Unavailable
from services.common.metric_labels import OTHER
from services.gateway.dispatch.deadlines import Deadlines
from services.gateway.dispatch.hold import HOLD_MARGIN_S, CallHold, HoldFull
from services.gateway.dispatch.retry_budget import RetryBudgets
from services.gateway.dispatch.retry_policy import (
    AttemptFailure,
    RetryDecision,
    RetryPolicy,
    RetryVerdict,
    WorkKind,
)
from services.gateway.dispatch.stream_resume import (
    DEFAULT_MAX_RESUMES,
    ResumeDecision,
    ResumeState,
    StreamMismatch,
)
from services.gateway.routing.circuit_breaker import CircuitBreakers
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.table import Route, RoutingTable
from services.gateway.telemetry import metrics
from services.gateway.telemetry.tracing import span
from services.gateway.upstream.clients import AttemptError, GenerateCall, SchedulerClient, SchedulerClients
from services.gateway.upstream.status import UpstreamCode

_tracer = trace.get_tracer("infermesh.gateway")

T = TypeVar("T")
# (client, version to ask for ("" lets the scheduler pick), timeout_s) -> the reply
UnaryCall = Callable[[SchedulerClient, str, float], Awaitable[T]]
# (client, version, timeout_s, continuation: token ids the client already has) -> the stream
StreamCall = Callable[[SchedulerClient, str, float, tuple[int, ...]], GenerateCall]


# When every scheduler was found gone, draining or without the model's workers: rounds of retrying
# them all, after 0.1, 0.2, 0.4, 0.8 s (a worker re-attaches within ~50 ms of its scheduler going;
# a drain hands work over within its 2 s grace).
MAX_REGROUPS = 4
SCHEDULER_SERVICE = "infermesh.v1.Scheduler"
REGROUP_BACKOFF_S = 0.1
# A call severed off a silent scheduler (its work was accepted and may still be idempotently redone)
# goes on with rounds, 0.8 s apart at most, until its deadline rather than MAX_REGROUPS: the other
# scheduler may have restarted a moment ago, its workers re-attaching within about a second and the
# round's poll seeing them. Still bounded per call (one attempt per scheduler per round) and by
# MAX_SILENT_REGROUPS for calls with long deadlines.
REGROUP_MAX_BACKOFF_S = 0.8
MAX_SILENT_REGROUPS = 10
# The retry hint of a known model that no scheduler tried serves right now (_final_error).
NOT_SERVED_NOW_RETRY_S = 1.0


@dataclass
class _Attempts:
    """One call's attempts so far: what its next route must avoid and what its regroup rounds need."""

    tried: list[str] = field(default_factory=list)
    last_failure: AttemptError | None = None
    regroups: int = 0
    # A live scheduler said "draining" or "not served here" to this call, or the gateway gave up on
    # a scheduler that stopped answering while another still answers polls (scheduler_silent).
    transient_seen: bool = False
    silent_seen: bool = False
    redispatch_counted: bool = False
    # Waits in the hold so far, and when the first began (None: never held).
    num_holds: int = 0
    held_since_s: float | None = None

    def failed(self, failure: AttemptError) -> None:
        self.last_failure = failure
        self.transient_seen |= _answered_transient(failure) or failure.scheduler_silent
        self.silent_seen |= failure.scheduler_silent

    @property
    def max_regroups(self) -> int:
        return MAX_SILENT_REGROUPS if self.silent_seen else MAX_REGROUPS


class _NoRoute(Exception):
    """No endpoint may be called now (all tried, or their breakers open) after `failure`;
    `error`: what routing said."""

    def __init__(self, failure: AttemptError, error: InfermeshError) -> None:
        super().__init__(failure.error.message)
        self.failure = failure
        self.error = error


class Dispatcher:
    def __init__(
        self,
        *,
        routing: RoutingTable,
        clients: SchedulerClients,
        policy: RetryPolicy,
        budgets: RetryBudgets,
        breakers: CircuitBreakers,
        deadlines: Deadlines,
        board: PressureBoard,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        max_resumes: int = DEFAULT_MAX_RESUMES,
        on_regroup: Callable[[], None] = lambda: None,
        hold: CallHold | None = None,
    ) -> None:
        """on_regroup: runs when a call starts a regroup round or a wait in the hold (the server polls
        every scheduler then, so one just restarted is known answering before the round ends, not a
        poll later). hold: where calls wait while no scheduler can take them; None: nothing is held."""
        self._routing = routing
        self._clients = clients
        self._policy = policy
        self._budgets = budgets
        self._breakers = breakers
        self._deadlines = deadlines
        self._board = board
        self._sleep = sleep
        self._max_resumes = max_resumes
        self._on_regroup = on_regroup
        self._holds = hold

    async def unary(self, scope, work: WorkKind, call: UnaryCall[T]) -> T:
        attempts = _Attempts()
        while True:
            route = await self._route_or_hold(scope, attempts)
            timeout_s = self._timeout_s(scope, route, attempts.last_failure)
            _slot(scope).attempt()
            with _attempt_span(len(attempts.tried), route, "Generate" if work is WorkKind.GENERATE else "Classify"):
                try:
                    result = await call(self._clients.get(route.endpoint), route.version, timeout_s)
                except AttemptError as failure:
                    attempts.failed(failure)
                    _note_unserved(scope, failure)
                    self._report(route, failure)
                    decision = self._retry_or_regroup(scope, work, route, failure, attempts, accepted=True)
                except BaseException:
                    route.permit.abandon()  # cancelled by the client: says nothing about the endpoint
                    raise
                else:
                    route.permit.success()
                    self._observe(route.endpoint)
                    self._wake_held(scope)
                    return result
            await self._next_attempt(scope, attempts, decision)

    async def stream(self, scope, call: StreamCall, on_chunk: Callable[[Any], None]) -> AsyncIterator:
        """The stream's chunks, over as many attempts and resumes as it takes; `on_chunk` sees each first."""
        attempts = _Attempts()
        resume = ResumeState(self._max_resumes)
        while True:
            route = await self._route_or_hold(scope, attempts, resume.version or scope.version)
            timeout_s = self._timeout_s(scope, route, attempts.last_failure)
            attempt_span = _tracer.start_span(
                "resume" if resume.num_delivered else "attempt", kind=trace.SpanKind.CLIENT,
                attributes={"infermesh.attempt": len(attempts.tried), "infermesh.endpoint": route.endpoint,
                            "infermesh.tokens_delivered": resume.num_delivered,
                            **_client_attributes(route, "Generate")},
            )
            _slot(scope).attempt()
            waiting = self._board.sent(route.endpoint, scope.model, scope.priority)  # queued there until its next poll
            with trace.use_span(attempt_span, end_on_exit=False):  # the call carries this span's traceparent
                upstream = call(self._clients.get(route.endpoint), route.version, timeout_s, resume.continuation())
            num_chunks = 0
            num_delivered_before = resume.num_delivered
            decision: RetryDecision | None
            try:
                async for chunk in upstream.chunks():
                    num_chunks += 1
                    if num_chunks == 1:
                        waiting.started()
                        self._wake_held(scope)  # this scheduler takes the model's calls
                        if route.permit.is_probe:
                            # A half-open breaker's question is answered: the scheduler serves. Held
                            # to the stream's end, the probe kept every other call off a scheduler
                            # that had just restarted for the seconds a stream lasts (classify
                            # severed off a frozen one could not fail over to it: DEADLINE_EXCEEDED).
                            route.permit.success()
                    resume.accept(chunk)
                    on_chunk(chunk)
                    yield chunk
                if not resume.finished:
                    raise _cut(route.endpoint)
            except AttemptError as failure:
                attempts.failed(failure)
                if not num_chunks:
                    _note_unserved(scope, failure)
                self._report(route, failure)
                if resume.finished:
                    # The last chunk reached the client before the call failed (a per-call stream severed
                    # between it and its status): the stream is whole. A continuation of it would be refused
                    # as complete, and the client, which has its finish_reason, would then see an error.
                    return
                if num_delivered_before and not num_chunks and self._may_hold(failure):
                    decision = self._resume_untaken(scope, route, attempts)
                elif resume.num_delivered:
                    resume_decision = self._resume(scope, resume, failure)
                    if not resume_decision.resume:
                        raise _final_error(scope, failure) from None
                    if resume_decision.delay_s > 0:
                        await self._sleep(resume_decision.delay_s)
                    continue
                else:
                    decision = self._retry_or_regroup(scope, WorkKind.GENERATE, route, failure, attempts,
                                                      accepted=num_chunks > 0)
            except StreamMismatch as exc:
                upstream.cancel()
                route.permit.record(UpstreamCode.INTERNAL)
                raise Internal(f"scheduler {route.endpoint} broke the stream: {exc}") from None
            except BaseException:
                upstream.cancel()  # the client went away: free the sequence's KV blocks now
                route.permit.abandon()
                raise
            else:
                route.permit.success()
                self._observe(route.endpoint)
                return
            finally:
                waiting.started()  # or ended without a first response: it waits there no longer
                attempt_span.end()
            await self._next_attempt(scope, attempts, decision)

    async def _route_or_hold(self, scope, attempts: _Attempts, version: str | None = None) -> Route:
        """The next attempt's route. When none may be called now after a round that began regrouping
        (e.g. a just-restarted scheduler's breaker opened on connects refused while its channel
        reconnected, and the other one is draining), wait for the next round instead of giving up;
        with no round left, or none begun (every breaker open), wait in the hold."""
        while True:
            try:
                return self._route(scope, attempts.tried, attempts.last_failure, version)
            except _NoRoute as no_route:
                _slot(scope).unserved()
                decision = self._regroup(scope, no_route.failure, attempts)
                if decision is not None:
                    await self._sleep(decision.delay_s)
                    continue
                error = _final_error(scope, no_route.failure)
                await self._hold(scope, attempts, error, holdable=isinstance(no_route.error, Unavailable))
            except Unavailable as no_endpoint:  # before any attempt: every breaker open, or none known
                _slot(scope).unserved()
                await self._hold(scope, attempts, no_endpoint, holdable=True)

    def _retry_or_regroup(self, scope, work: WorkKind, route: Route, failure: AttemptError, attempts: _Attempts,
                          *, accepted: bool) -> RetryDecision | None:
        """After a failed attempt that sent the client nothing: a retry or failover, else a regroup
        round; None when neither may go (the call is then held, or fails)."""
        decision = self._decide(scope, work, route, failure, attempts.tried, accepted=accepted, num_tokens_sent=0)
        if not decision.retry:
            regrouped = self._regroup(scope, failure, attempts)
            if regrouped is None:
                return None
            decision = regrouped
        _count_redispatch(scope, attempts)
        return decision

    async def _next_attempt(self, scope, attempts: _Attempts, decision: RetryDecision | None) -> None:
        """Waits before the next attempt: the retry's delay, or in the hold when no retry may go
        (None), which raises the last failure's error when the call may not be held."""
        if decision is not None:
            await self._sleep(decision.delay_s)
            return
        failure = attempts.last_failure
        if failure is None:  # only a failed attempt leaves no decision
            raise Internal("no attempt failed, yet no retry was decided")
        await self._hold(scope, attempts, _final_error(scope, failure), holdable=_holdable(failure))

    def _may_hold(self, failure: AttemptError) -> bool:
        return self._holds is not None and self._holds.enabled and _holdable(failure)

    def _resume_untaken(self, scope, route: Route, attempts: _Attempts) -> RetryDecision | None:
        """A resumed attempt failed before its first chunk because no scheduler could take it: it
        goes at once to a scheduler it has not tried, else waits in the hold (None), and counts as
        no further resume either way (each is bounded: by the schedulers, and by the hold)."""
        if self._has_untried(scope.model, route.version, attempts.tried):
            return RetryDecision(RetryVerdict.FAILOVER)
        return None

    async def _hold(self, scope, attempts: _Attempts, error: InfermeshError, *, holdable: bool) -> None:
        """Holds the call until a scheduler may take it (hold.py), then returns for its next attempt.

        Raises `error` when the call may not be held: nothing is held here, the failure was a live
        scheduler's answer (`holdable` False), the target is unknown, the deadline leaves no time,
        or the hold is full (UNAVAILABLE, saying so). A call that was held and ran out of time
        fails DEADLINE_EXCEEDED, saying for how long no scheduler could take it."""
        hold = self._holds
        if hold is None or not hold.enabled or not holdable or not _knows_target(scope):
            raise error
        now_s = self._deadlines.clock()
        remaining_s = scope.deadline.remaining_s(now_s)
        max_wait_s = remaining_s - HOLD_MARGIN_S - self._deadlines.policy.hop_margin_s - self._board.min_service_time_s(
            scope.model)
        if max_wait_s <= 0:
            if attempts.held_since_s is None:
                raise error
            raise _held_too_long(now_s - attempts.held_since_s, remaining_s, error)
        if hold.full:
            metrics.HELD_CALLS.labels(scope.metric_model, "refused").inc()
            raise Unavailable(f"{error.message}; not held: {hold.max_held} calls already wait for a scheduler at "
                              "this gateway (--hold-max-calls)", retry_after_s=NOT_SERVED_NOW_RETRY_S)
        if attempts.held_since_s is None:
            attempts.held_since_s = now_s
            metrics.HELD_CALLS.labels(scope.metric_model, "held").inc()
        self._on_regroup()  # poll every scheduler now: one that answers with the model ready wakes the call
        _slot(scope).unserved()
        # The hold's cap bounds held calls, and the burst of them when a scheduler returns; the model's
        # limit, new calls. A woken call retaking its slot past the limit had new calls refused
        # RESOURCE_EXHAUSTED while the burst drained (22-26 classify a run at the default limit, issue 35).
        _leave_limit(scope)
        try:
            woken = await hold.wait(scope.model, num_waits=attempts.num_holds, max_wait_s=max_wait_s,
                                    label=scope.metric_model)
        except HoldFull:  # cannot happen on one event loop: `full` was just checked
            raise error from None
        if not woken:  # what is left is the margin to finish in
            now_s = self._deadlines.clock()
            raise _held_too_long(now_s - attempts.held_since_s, scope.deadline.remaining_s(now_s), error)
        if attempts.num_holds == 0:  # it goes out again: once per call, apart from new calls
            metrics.REDISPATCHES.labels(scope.metric_model, "held").inc()
        attempts.num_holds += 1
        attempts.tried.clear()

    def _wake_held(self, scope) -> None:
        """A call of the model succeeded: its held calls may go now."""
        if self._holds is not None:
            self._holds.wake((scope.model,))

    def _regroup(self, scope, failure: AttemptError, attempts: _Attempts) -> RetryDecision | None:
        """Every scheduler was tried and each was gone, draining or without the model's workers,
        and at least one live scheduler said so itself during this call (draining, or "not served
        here"): the transient states of a roll or a restart, as workers move within about a second.
        Wait a little and try them all again, within the deadline, a few rounds at most; None: give
        up. Later rounds go on when every scheduler is merely unreachable by then (the draining one
        exited, the restarted one's channel still reconnects, its breaker open).

        Only for a model and a version the gateway knows (a made-up name or version gets its
        NOT_FOUND at once: waiting rounds for one held the model's concurrency slots for ~1.5 s a
        request, so a tenant asking for versions that do not exist shut the model's other callers
        out), and only when a live scheduler answered: endpoints that are merely unreachable stay
        with the retry budget and the breakers, so a dead replica set cannot turn this into a retry
        storm."""
        gone = failure.endpoint_gone or failure.code == UpstreamCode.NOT_FOUND
        if (not (gone and attempts.transient_seen) or attempts.regroups >= attempts.max_regroups
                or not _knows_target(scope)):
            return None
        delay_s = min(REGROUP_BACKOFF_S * 2**attempts.regroups, REGROUP_MAX_BACKOFF_S)
        if delay_s + self._board.min_service_time_s(scope.model) >= scope.deadline.remaining_s(self._deadlines.clock()):
            return None
        attempts.tried.clear()
        attempts.regroups += 1
        metrics.RETRIES.labels(scope.metric_model, "*", "regroup").inc()
        self._on_regroup()
        return RetryDecision(RetryVerdict.RETRY, delay_s=delay_s)

    def _resume(self, scope, resume: ResumeState, failure: AttemptError) -> ResumeDecision:
        decision = resume.decide(
            failure.code, failure.pushback_ms, failure.error.message, cut=isinstance(failure, StreamCut),
            remaining_s=scope.deadline.remaining_s(self._deadlines.clock()),
            min_service_time_s=self._board.min_service_time_s(scope.model),
        )
        if decision.resume and decision.reason is not None:  # a resume always says why
            metrics.STREAM_RESUMES.labels(scope.metric_model, decision.reason.value).inc()
        return decision

    # -- one attempt's steps ----------------------------------------------------------

    def _route(self, scope, tried: list[str], last_failure: AttemptError | None, version: str | None = None) -> Route:
        try:
            route = self._routing.choose(scope.model, scope.version if version is None else version,
                                         exclude=frozenset(tried), priority=scope.priority,
                                         ttft_target_s=_ttft_target_s(scope))
        except InfermeshError as exc:
            if last_failure is not None:  # every breaker opened meanwhile: report what really failed
                raise _NoRoute(last_failure, exc) from None
            raise
        if not tried:
            self._budgets.for_upstream(route.endpoint).record_request()
        tried.append(route.endpoint)
        if route.version:  # the request's metrics carry the version it was routed to
            scope.served_version = route.version
        return route

    def _timeout_s(self, scope, route: Route, last_failure: AttemptError | None) -> float:
        try:
            return self._deadlines.downstream_timeout_s(scope.deadline)
        except InfermeshError:
            route.permit.abandon()
            if last_failure is not None:
                raise last_failure.error from None
            raise

    def _report(self, route: Route, failure: AttemptError) -> None:
        if failure.answered_by_scheduler:
            route.permit.success()  # it answered with a retry hint: alive, just no room for this
        else:
            route.permit.record(failure.code)
        if failure.endpoint_gone:
            # Later calls avoid it now rather than after its next failed poll or its breaker opening.
            self._routing.note_gone(route.endpoint)
        elif failure.code == UpstreamCode.NOT_FOUND:
            self._routing.note_not_serving(route.endpoint, route.model)
        self._observe(route.endpoint)

    def _decide(
        self, scope, work: WorkKind, route: Route, failure: AttemptError, tried: list[str],
        *, accepted: bool, num_tokens_sent: int,
    ) -> RetryDecision:
        budget = self._budgets.for_upstream(route.endpoint)
        gone = failure.endpoint_gone or failure.code == UpstreamCode.NOT_FOUND
        decision = self._policy.decide(
            work=work,
            failure=AttemptFailure(failure.code, accepted, num_tokens_sent, failure.pushback_ms, gone),
            num_attempts=len(tried),
            remaining_s=scope.deadline.remaining_s(self._deadlines.clock()),
            budget=budget,
            min_service_time_s=self._board.min_service_time_s(scope.model),
            can_fail_over=gone and self._has_untried(scope.model, route.version, tried),
        )
        if decision.verdict is RetryVerdict.FAILOVER:
            metrics.FAILOVERS.labels(scope.metric_model).inc()
        if decision.verdict is not RetryVerdict.NOT_RETRYABLE:
            metrics.RETRIES.labels(scope.metric_model, route.endpoint, decision.verdict.value).inc()
        metrics.RETRY_BUDGET_REMAINING.labels(route.endpoint).set(budget.balance())
        return decision

    def _has_untried(self, model: str, version: str, tried: list[str]) -> bool:
        """Is there an endpoint for the call's model version that it has not tried and may call now?"""
        try:
            return bool(self._routing.candidates(model, version, frozenset(tried)).untried)
        except NotFound:
            return False

    def _observe(self, endpoint: str) -> None:
        state = self._breakers.for_endpoint(endpoint).state
        metrics.BREAKER_STATE.labels(endpoint).set(metrics.BREAKER_STATE_VALUE[state.value])


class ModelSlot(Protocol):
    """The request's slot in its model's adaptive limit (admission/adaptive_limit.LimitPermit): its
    latency sample is the time a scheduler served it (it also leaves the limit once held: _leave_limit)."""

    def attempt(self) -> None: ...

    def unserved(self, *, from_attempt: bool = False) -> None: ...


class _NoSlot:
    """A scope that holds no model slot (admission refused none, or a test's plain scope)."""

    def attempt(self) -> None:
        return None

    def unserved(self, *, from_attempt: bool = False) -> None:
        return None


_NO_SLOT = _NoSlot()


def _slot(scope) -> ModelSlot:
    slot = getattr(scope, "model_permit", None)
    return _NO_SLOT if slot is None else slot


def _leave_limit(scope) -> None:
    """A held call leaves its model's adaptive limit for good (see _hold); the in-flight gauge follows."""
    permit = getattr(scope, "model_permit", None)
    if permit is None:
        return
    permit.step_out()
    metrics.observe_model_in_flight(scope.metric_model, permit.num_in_flight)


def _note_unserved(scope, failure: AttemptError) -> None:
    """An attempt failed because no scheduler could take it: its time is no upstream latency."""
    if _holdable(failure):
        _slot(scope).unserved(from_attempt=True)


def _count_redispatch(scope, attempts: _Attempts) -> None:
    """A call severed off a silent scheduler goes out again: counted once per call, apart from new
    calls (and from ordinary retries), so a dashboard shows how much of a hung scheduler's load was
    re-sent."""
    if attempts.silent_seen and not attempts.redispatch_counted:
        attempts.redispatch_counted = True
        metrics.REDISPATCHES.labels(scope.metric_model, "scheduler_silent").inc()


def _held_too_long(held_s: float, remaining_s: float, error: InfermeshError) -> DeadlineExceeded:
    return DeadlineExceeded(f"deadline exceeded while held: no scheduler could take the call for {held_s:.1f} s, "
                            f"{remaining_s * 1000:.0f} ms left (last: {error.message})")


def _holdable(failure: AttemptError) -> bool:
    """The failure proves that no scheduler could take the call, not that a live one refused it:
    gone or draining, silent, or not serving the model (a known one: see _hold)."""
    return failure.endpoint_gone or failure.scheduler_silent or failure.code == UpstreamCode.NOT_FOUND


def _knows_target(scope) -> bool:
    """Whether the gateway knows the call's model (routing file, or a scheduler's report) and, when
    the call names one, its version: metrics label anything else OTHER."""
    return scope.metric_model != OTHER and not (scope.version and scope.metric_version == OTHER)


def _final_error(scope, failure: AttemptError) -> InfermeshError:
    """What the client gets when its call gives up after `failure`.

    NOT_FOUND "not served here" for a model this gateway knows (its routing file names it, or a
    scheduler in discovery reported it) and a version it knows means that no scheduler tried holds
    the model's workers *now*: a fresh scheduler answered while the one holding them hung, until
    the workers re-attached (~7 s). That is UNAVAILABLE with a retry hint, which clients retry;
    NOT_FOUND (HTTP 404 model_not_found) told them the model does not exist. A made-up model or
    version keeps its NOT_FOUND."""
    if failure.code != UpstreamCode.NOT_FOUND or not _knows_target(scope):
        return failure.error
    return Unavailable(f"no scheduler serves model '{scope.model}' right now ({failure.error.message}); "
                       "retry shortly", retry_after_s=NOT_SERVED_NOW_RETRY_S)


def _answered_transient(failure: AttemptError) -> bool:
    """A live scheduler said "not now, not here": draining (retry elsewhere at once) or "not served here"."""
    return failure.code == UpstreamCode.NOT_FOUND or (
        failure.code == UpstreamCode.UNAVAILABLE and failure.retry_at_once)


class StreamCut(AttemptError):
    """The upstream stream ended without its final chunk (no status says why)."""


def _cut(endpoint: str) -> StreamCut:
    local = AttemptError.local(UpstreamCode.UNAVAILABLE, f"scheduler {endpoint} ended the stream before its last chunk")
    return StreamCut(local.error, local.code, None)


def _client_attributes(route: Route, method: str) -> dict[str, str | int]:
    """OpenTelemetry RPC conventions for the upstream call: with the attempt as a CLIENT span,
    service graphs draw the gateway -> scheduler edge."""
    host, _, port = route.endpoint.rpartition(":")
    attributes: dict[str, str | int] = {"rpc.system": "grpc", "rpc.service": SCHEDULER_SERVICE, "rpc.method": method,
                                        "server.address": host}
    if port.isdigit():
        attributes["server.port"] = int(port)
    return attributes


def _attempt_span(number: int, route: Route, method: str):
    return span("attempt", kind=trace.SpanKind.CLIENT,
                **{"infermesh.attempt": number, "infermesh.endpoint": route.endpoint, **_client_attributes(route, method)})


def _ttft_target_s(scope) -> float | None:
    """A Generate's TTFT target for routing (replicas predicted to meet it first), over the correction admission
    applied to its class's predictions (admission/ttft_calibration.py), less its own prompt's prefill (the
    replicas predict a one-token prompt): a replica's own prediction meets this when, with the prompt's prefill
    and corrected, it meets the target; None otherwise."""
    objective = getattr(scope, "objective", None)
    if objective is None:
        return None
    return objective.ttft_ms / 1000 / getattr(scope, "ttft_correction", 1.0) - getattr(scope, "own_prefill_s", 0.0)
