"""Attempts: route, call the scheduler, and retry what the policy and the budget allow.

Each attempt takes a route (an endpoint whose circuit breaker admits the call),
calls it with the deadline's remaining time minus the hop margin, and reports
the outcome to that endpoint's breaker. A failure goes to the retry policy,
which pays for a retry from the failed endpoint's budget; the next attempt
prefers an endpoint not tried yet. A Generate stream is never retried once a
token reached the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from opentelemetry import trace

from services.common.errors import InfermeshError
from services.gateway import metrics
from services.gateway.admission import span
from services.gateway.circuit_breaker import CircuitBreakers
from services.gateway.deadlines import Deadlines
from services.gateway.retry_budget import RetryBudgets
from services.gateway.retry_policy import AttemptFailure, RetryDecision, RetryPolicy, RetryVerdict, WorkKind
from services.gateway.routing import Route, RoutingTable
from services.gateway.shedding import PressureBoard
from services.gateway.upstream import AttemptError, GenerateCall, SchedulerClient, SchedulerClients

_tracer = trace.get_tracer("infermesh.gateway")

T = TypeVar("T")
Clock = Callable[[], float]
# (client, version to ask for ("" lets the scheduler pick), timeout_s) -> the reply
UnaryCall = Callable[[SchedulerClient, str, float], Awaitable[T]]
StreamCall = Callable[[SchedulerClient, str, float], GenerateCall]


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
    ) -> None:
        self._routing = routing
        self._clients = clients
        self._policy = policy
        self._budgets = budgets
        self._breakers = breakers
        self._deadlines = deadlines
        self._board = board
        self._sleep = sleep

    async def unary(self, scope, work: WorkKind, call: UnaryCall[T]) -> T:
        tried: list[str] = []
        last_failure: AttemptError | None = None
        while True:
            route = self._route(scope, tried, last_failure)
            timeout_s = self._timeout_s(scope, route, last_failure)
            with _attempt_span(len(tried), route):
                try:
                    result = await call(self._clients.get(route.endpoint), route.version, timeout_s)
                except AttemptError as failure:
                    last_failure = failure
                    self._report(route, failure)
                    decision = self._decide(scope, work, route, failure, len(tried), accepted=True, num_tokens_sent=0)
                    if not decision.retry:
                        raise failure.error from None
                except BaseException:
                    route.permit.abandon()  # cancelled by the client: says nothing about the endpoint
                    raise
                else:
                    route.permit.success()
                    self._observe(route.endpoint)
                    return result
            await self._sleep(decision.delay_s)

    async def stream(self, scope, call: StreamCall, on_chunk: Callable[[object], None]) -> AsyncIterator:
        """Chunks of the first attempt that streams; `on_chunk` sees each before it is yielded."""
        tried: list[str] = []
        last_failure: AttemptError | None = None
        while True:
            route = self._route(scope, tried, last_failure)
            timeout_s = self._timeout_s(scope, route, last_failure)
            attempt_span = _tracer.start_span(
                "attempt", attributes={"infermesh.attempt": len(tried), "infermesh.endpoint": route.endpoint}
            )
            with trace.use_span(attempt_span, end_on_exit=False):  # the call carries this span's traceparent
                upstream = call(self._clients.get(route.endpoint), route.version, timeout_s)
            num_chunks = num_tokens_sent = 0
            try:
                async for chunk in upstream.chunks():
                    num_chunks += 1
                    num_tokens_sent += len(chunk.token_ids)
                    on_chunk(chunk)
                    yield chunk
            except AttemptError as failure:
                last_failure = failure
                self._report(route, failure)
                decision = self._decide(
                    scope, WorkKind.GENERATE, route, failure, len(tried),
                    accepted=num_chunks > 0, num_tokens_sent=num_tokens_sent,
                )
                if not decision.retry:
                    raise failure.error from None
            except BaseException:
                upstream.cancel()  # the client went away: free the sequence's KV blocks now
                route.permit.abandon()
                raise
            else:
                route.permit.success()
                self._observe(route.endpoint)
                return
            finally:
                attempt_span.end()
            await self._sleep(decision.delay_s)

    # -- one attempt's steps ----------------------------------------------------------

    def _route(self, scope, tried: list[str], last_failure: AttemptError | None) -> Route:
        try:
            route = self._routing.choose(scope.model, scope.version, exclude=frozenset(tried))
        except InfermeshError:
            if last_failure is not None:  # every breaker opened meanwhile: report what really failed
                raise last_failure.error from None
            raise
        if not tried:
            self._budgets.for_upstream(route.endpoint).record_request()
        tried.append(route.endpoint)
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
        self._observe(route.endpoint)

    def _decide(
        self, scope, work: WorkKind, route: Route, failure: AttemptError, num_attempts: int,
        *, accepted: bool, num_tokens_sent: int,
    ) -> RetryDecision:
        budget = self._budgets.for_upstream(route.endpoint)
        decision = self._policy.decide(
            work=work,
            failure=AttemptFailure(failure.code, accepted, num_tokens_sent, failure.pushback_ms),
            num_attempts=num_attempts,
            remaining_s=scope.deadline.remaining_s(self._deadlines.clock()),
            budget=budget,
            min_service_time_s=self._board.min_service_time_s(scope.model),
        )
        if decision.verdict is not RetryVerdict.NOT_RETRYABLE:
            metrics.RETRIES.labels(scope.model, route.endpoint, decision.verdict.value).inc()
        metrics.RETRY_BUDGET_REMAINING.labels(route.endpoint).set(budget.balance())
        return decision

    def _observe(self, endpoint: str) -> None:
        state = self._breakers.for_endpoint(endpoint).state
        metrics.BREAKER_STATE.labels(endpoint).set(metrics.BREAKER_STATE_VALUE[state])


def _attempt_span(number: int, route: Route):
    return span("attempt", **{"infermesh.attempt": number, "infermesh.endpoint": route.endpoint})
