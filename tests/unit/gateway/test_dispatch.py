"""The attempt loop: retries by policy and budget, breaker reports, Generate never retried after a token."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.priority import Priority
from services.gateway.dispatch.deadlines import Deadline, DeadlinePolicy, Deadlines
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.retry_budget import RetryBudgetConfig, RetryBudgets
from services.gateway.dispatch.retry_policy import RetryPolicy, RetryPolicyConfig, WorkKind
from services.gateway.routing.circuit_breaker import BreakerConfig, BreakerState, CircuitBreakers
from services.gateway.routing.pressure import PressureBoard, PressureReport
from services.gateway.routing.table import RoutingTable
from services.gateway.upstream.clients import AttemptError
from services.gateway.upstream.status import UpstreamCode
from tests.unit.gateway.conftest import FixedRng

ENDPOINT = "10.0.0.1:50052"


def _unavailable(pushback_ms: int | None = None) -> AttemptError:
    return AttemptError(Unavailable("connection refused"), UpstreamCode.UNAVAILABLE, pushback_ms)


class FakeClients:
    def __init__(self) -> None:
        self.addresses: list[str] = []

    def get(self, address: str):
        self.addresses.append(address)
        return address


class FakeStream:
    """A Generate call that yields `chunks`, then raises `error` (if any)."""

    def __init__(self, chunks, error: AttemptError | None = None, block: bool = False) -> None:
        self._chunks = chunks
        self._error = error
        self._block = block
        self.cancelled = False
        self.blocked = asyncio.Event()

    async def chunks(self):
        for chunk in self._chunks:
            yield chunk
        if self._block:
            self.blocked.set()
            await asyncio.Event().wait()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        self.cancelled = True


def _chunk(index: int, *token_ids: int, final: bool = False) -> gateway_pb2.GenerateResponse:
    chunk = gateway_pb2.GenerateResponse(token_ids=token_ids, index=index)
    if final:
        chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
        chunk.usage.completion_tokens = index + len(token_ids)
    return chunk


@pytest.fixture
def parts(clock):
    breakers = CircuitBreakers(BreakerConfig(num_consecutive_failures_to_open=2, open_cooldown_s=5), clock)
    budgets = RetryBudgets(RetryBudgetConfig(retry_ratio=0.0, window_s=10, min_retries_per_s=0.2), clock)
    deadlines = Deadlines(DeadlinePolicy(), clock)
    sleeps: list[float] = []

    async def sleep(delay_s: float) -> None:
        sleeps.append(delay_s)

    dispatcher = Dispatcher(
        routing=RoutingTable((), breakers, fallback_endpoint=ENDPOINT),
        clients=FakeClients(),
        policy=RetryPolicy(RetryPolicyConfig(max_attempts=3), rng=FixedRng(0.5)),
        budgets=budgets,
        breakers=breakers,
        deadlines=deadlines,
        board=PressureBoard(clock),
        sleep=sleep,
    )
    scope = SimpleNamespace(
        model="digits", metric_model="digits", version="", priority=Priority.STANDARD,
        deadline=Deadline(expires_at_s=clock() + 10),
    )
    return SimpleNamespace(dispatcher=dispatcher, scope=scope, breakers=breakers, budgets=budgets, sleeps=sleeps)


def _scripted(*outcomes):
    """A unary call that fails or answers in the given order; records each attempt's version."""
    calls = []

    async def call(client, version, timeout_s):
        calls.append((client, version))
        outcome = outcomes[len(calls) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return call, calls


async def test_classify_is_retried_after_unavailable_with_backoff(parts):
    call, calls = _scripted(_unavailable(), "labels")
    assert await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call) == "labels"
    assert calls == [(ENDPOINT, ""), (ENDPOINT, "")]
    assert parts.sleeps == [0.0125]  # full jitter 0.5 x 25 ms


async def test_scheduler_pushback_replaces_backoff_and_is_not_a_breaker_failure(parts):
    call, _ = _scripted(_unavailable(pushback_ms=300), _unavailable(pushback_ms=300), "labels")
    assert await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call) == "labels"
    assert parts.sleeps == [0.3, 0.3]
    assert parts.breakers.for_endpoint(ENDPOINT).state is BreakerState.CLOSED


async def test_non_retryable_error_surfaces_at_once(parts):
    call, calls = _scripted(AttemptError(InvalidArgument("bad image"), UpstreamCode.INVALID_ARGUMENT, None))
    with pytest.raises(InvalidArgument, match="bad image"):
        await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call)
    assert len(calls) == 1


async def test_retries_stop_when_the_budget_is_spent(parts):
    # Floor 0.2/s over 10 s = 2 retries for the whole window, ratio 0: the third request gets none.
    for _ in range(2):
        call, calls = _scripted(_unavailable(), "ok")
        await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call)
    call, calls = _scripted(_unavailable(), "ok")
    with pytest.raises(Unavailable, match="connection refused"):
        await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call)
    assert len(calls) == 1


async def test_open_breaker_fails_fast_without_calling(parts):
    call, calls = _scripted(_unavailable(), _unavailable(), _unavailable())
    with pytest.raises(Unavailable, match="connection refused"):
        await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call)
    assert len(calls) == 2, "the second failure opened the breaker; the last error is reported"
    call, calls = _scripted("never")
    with pytest.raises(Unavailable, match="circuit open for all 1 endpoints") as info:
        await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call)
    assert calls == [] and info.value.retry_after_s == 5


async def test_generate_is_retried_when_it_failed_before_any_chunk(parts):
    streams = [FakeStream([], _unavailable()), FakeStream([_chunk(0, 1), _chunk(1, 2, final=True)])]
    seen = []
    out = [c async for c in parts.dispatcher.stream(parts.scope, lambda *_: streams.pop(0), seen.append)]
    assert [list(c.token_ids) for c in out] == [[1], [2]] and seen == out


async def test_generate_is_resumed_not_retried_once_a_token_was_sent(parts):
    streams = [FakeStream([_chunk(0, 7)], _unavailable()), FakeStream([_chunk(1, 8, final=True)])]
    continuations = []

    def call(client, version, timeout_s, continuation):
        continuations.append(continuation)
        return streams.pop(0)

    out = [c async for c in parts.dispatcher.stream(parts.scope, call, lambda c: None)]
    assert [list(c.token_ids) for c in out] == [[7], [8]]
    assert continuations == [(), (7,)], "the second attempt continues from the token delivered"
    assert parts.sleeps == [], "a resume goes at once, with no backoff"


async def test_a_call_that_fails_after_its_last_chunk_is_a_whole_stream_not_resumed(parts):
    # A per-call stream severed (a silent scheduler's calls failed over) after the final chunk, before its
    # status: the client has every token and the finish_reason. Found by a fresh clone's suite: the resume
    # sent all 80 tokens as a continuation and the client got INVALID_ARGUMENT after its last chunk.
    streams = [FakeStream([_chunk(0, 7), _chunk(1, 8, final=True)], _unavailable())]
    calls = []

    def call(client, version, timeout_s, continuation):
        calls.append(continuation)
        return streams.pop(0)

    out = [c async for c in parts.dispatcher.stream(parts.scope, call, lambda c: None)]
    assert [list(c.token_ids) for c in out] == [[7], [8]] and out[-1].finish_reason
    assert calls == [()], "no resume"


async def test_generate_is_not_resumed_after_an_answer_a_continuation_would_get_again(parts):
    error = AttemptError(InvalidArgument("prompt too long"), UpstreamCode.INVALID_ARGUMENT, None)
    streams = [FakeStream([_chunk(0, 7)], error), FakeStream([_chunk(1, 8, final=True)])]
    out = []
    with pytest.raises(InvalidArgument):
        async for chunk in parts.dispatcher.stream(parts.scope, lambda *_: streams.pop(0), lambda c: None):
            out.append(chunk)
    assert [list(c.token_ids) for c in out] == [[7]]
    assert len(streams) == 1, "no second attempt"


async def test_client_cancellation_cancels_the_upstream_stream(parts):
    stream = FakeStream([_chunk(0, 1)], block=True)

    async def consume():
        async for _ in parts.dispatcher.stream(parts.scope, lambda *_: stream, lambda c: None):
            pass

    task = asyncio.create_task(consume())
    await stream.blocked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.cancelled
    assert parts.breakers.for_endpoint(ENDPOINT).state is BreakerState.CLOSED


async def test_a_streams_first_chunk_closes_a_half_open_breaker_for_the_other_calls(parts, clock):
    """A Generate stream that probes a half-open breaker (a scheduler just restarted) answers the
    probe with its first chunk, not its last: meanwhile classify goes there too."""
    call, _ = _scripted(_unavailable(), _unavailable())
    with pytest.raises(Unavailable):
        await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call)
    breaker = parts.breakers.for_endpoint(ENDPOINT)
    breaker.answered_poll()  # it answers polls again
    assert breaker.state is BreakerState.HALF_OPEN
    stream = FakeStream([_chunk(0, 1)], block=True)

    async def consume():
        async for _ in parts.dispatcher.stream(parts.scope, lambda *_: stream, lambda c: None):
            pass

    task = asyncio.create_task(consume())
    await stream.blocked.wait()  # the stream goes on, its first chunk delivered
    assert breaker.state is BreakerState.CLOSED
    call, calls = _scripted("labels")
    assert await parts.dispatcher.unary(parts.scope, WorkKind.CLASSIFY, call) == "labels"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_each_stream_attempt_counts_on_the_board_against_the_endpoint_it_went_to(parts):
    """PressureBoard.sent: a stream queues at the endpoint it went to until that endpoint's next poll, and the
    next stream's predicted TTFT counts it (routing/pressure.py predicted_ttft_s); a retry counts where it went."""
    board = parts.dispatcher._board
    board.update(ENDPOINT, [PressureReport.from_fields("digits", [0, 0, 0, 0], 0, 0.0, 1, 0, 8, [0, 0, 100_000, 0],
                                                       5_000, [0, 0, 40_000, 0])])
    streams = [FakeStream([], _unavailable()), FakeStream([_chunk(0, 1, final=True)])]
    [c async for c in parts.dispatcher.stream(parts.scope, lambda *_: streams.pop(0), lambda c: None)]
    assert board.predicted_ttft_s(board.pressure("digits"), Priority.STANDARD) == pytest.approx(0.1 + 2 * 0.04)


async def test_a_stream_attempt_waits_on_the_board_until_its_first_chunk_or_its_end(parts):
    """PressureBoard.nothing_waiting: a stream sent since the poll waits there until its first chunk arrives (a
    blocked stream before it), or its attempt ends without one (a refusal); then nothing waits there again."""
    board = parts.dispatcher._board
    board.update(ENDPOINT, [PressureReport.from_fields("digits", [0, 0, 0, 0], 0, 0.0, 1, 0, 8, [0, 0, 100_000, 0],
                                                       5_000, [0, 0, 40_000, 0])])
    assert board.nothing_waiting("digits", Priority.STANDARD, 1.0)
    refused = FakeStream([], AttemptError(ResourceExhausted("full"), UpstreamCode.RESOURCE_EXHAUSTED, 100))
    with pytest.raises(ResourceExhausted):
        [c async for c in parts.dispatcher.stream(parts.scope, lambda *_: refused, lambda c: None)]
    assert board.nothing_waiting("digits", Priority.STANDARD, 1.0), "a refused attempt waits nowhere"

    blocked = FakeStream([], block=True)
    reading = asyncio.ensure_future(_read_all(parts.dispatcher.stream(parts.scope, lambda *_: blocked, lambda c: None)))
    await blocked.blocked.wait()
    assert not board.nothing_waiting("digits", Priority.STANDARD, 1.0), "sent, no first chunk yet"
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert board.nothing_waiting("digits", Priority.STANDARD, 1.0)

    started = FakeStream([_chunk(0, 1)], block=True)
    reading = asyncio.ensure_future(_read_all(parts.dispatcher.stream(parts.scope, lambda *_: started, lambda c: None)))
    await started.blocked.wait()
    assert board.nothing_waiting("digits", Priority.STANDARD, 1.0), "it runs there: it waits no longer"
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading


async def _read_all(chunks) -> list:
    return [c async for c in chunks]
