"""One Submit stream per scheduler endpoint, carrying every classify and generate call to it.

Calls are entries on one long-lived bidirectional stream (Scheduler.Submit)
instead of an RPC each. The stream is opened on first use and again after it
breaks. A call is: an id from the call table, an entry in the outbox, and a
handler the reader routes its replies to (a future for classify, a chunk queue
for generate). The writer sends everything queued in one event-loop turn as one
SubmitBatch.

What the dispatcher sees is the unary client's contract: `AttemptError` with
the scheduler's code, message and pushback; DEADLINE_EXCEEDED when a call's
timeout passes here first (the gateway's deadline holds even if the scheduler
never answers; a cancel entry tells it to stop); UNAVAILABLE without pushback
for every call in flight when the stream breaks, which the retry policy and the
circuit breaker treat like a refused connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.common.log_context import clean_context
from services.gateway.upstream.attempt_error import AttemptError
from services.gateway.upstream.call_table import CallTable
from services.gateway.upstream.status import UpstreamCode
from services.gateway.upstream.submit_outbox import EntryOutbox, encode_call, encode_cancel

log = logging.getLogger(__name__)

# What grpc reports for an RPC whose deadline passed; the unary path gives the client this message.
DEADLINE_MESSAGE = "Deadline Exceeded"
# Handler of one call: a future (classify) or a queue of chunks and at most one AttemptError (generate).
Handler = asyncio.Future | asyncio.Queue


class StreamGenerateCall:
    """One Generate call on the stream: iterate for chunks; `cancel()` when abandoning it."""

    __slots__ = ("_stream", "_call_id", "_queue")

    def __init__(self, stream: SchedulerStream, call_id: int, queue: asyncio.Queue) -> None:
        self._stream = stream
        self._call_id = call_id
        self._queue = queue

    async def chunks(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        queue = self._queue
        while True:
            item = await queue.get()
            if isinstance(item, AttemptError):
                raise item
            yield item
            if item.finish_reason:
                return

    def cancel(self) -> None:
        # The scheduler aborts the sequence and frees its KV blocks within one step.
        self._stream.abandon(self._call_id)


class SchedulerStream:
    def __init__(self, address: str, open_call: Callable[[], grpc.aio.StreamStreamCall], max_message_bytes: int,
                 clock: Callable[[], float] = time.monotonic,
                 call_later: Callable[[float, Callable[[], None]], asyncio.TimerHandle] | None = None) -> None:
        """open_call: starts a Submit RPC whose requests are SubmitBatch bytes (submit_outbox.py) and
        whose responses are ReplyBatch messages; it is written to and read from here.
        max_message_bytes: the largest message the scheduler accepts.
        clock and call_later (the event loop's by default) drive the deadline timer; tests fake both."""
        self._address = address
        self._open_call = open_call
        self._clock = clock
        self._call_later = call_later
        self._calls: CallTable[Handler] = CallTable(clock)
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: tuple[asyncio.Task, ...] = ()
        self._wake = asyncio.Event()
        self._outbox = EntryOutbox(max_message_bytes, self._wake.set)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at_s: float | None = None
        # When the scheduler last sent anything on the stream (clock seconds); None before the first reply.
        self._heard_at_s: float | None = None

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def silent_for_s(self) -> float:
        """Seconds since the scheduler last sent anything on the stream (or since it was opened)."""
        return 0.0 if self._heard_at_s is None else self._clock() - self._heard_at_s

    def sever(self, why: str) -> int:
        """Gives up on a scheduler that stopped answering: every call in flight fails with UNAVAILABLE
        (no pushback: the dispatcher fails over or resumes it) and the next call opens a new stream.
        A partition resets nothing, so without this the calls would wait for their deadlines.
        Returns the number of calls failed."""
        if self._call is None:
            return 0
        num_calls = len(self._calls)
        self._broken(self._call, why, scheduler_silent=True)
        return num_calls

    # -- calls -----------------------------------------------------------------

    async def classify(self, request: scheduler_pb2.ScheduleClassifyRequest, timeout_s: float,
                       trace_context: dict[str, str]) -> gateway_pb2.ClassifyResponse:
        future = asyncio.get_running_loop().create_future()
        call_id = self._open(future, request, timeout_s, trace_context)
        try:
            return await future
        except asyncio.CancelledError:
            self.abandon(call_id)  # the client went away: the scheduler drops the item if not yet run
            raise

    def generate(self, request: scheduler_pb2.ScheduleGenerateRequest, timeout_s: float,
                 trace_context: dict[str, str]) -> StreamGenerateCall:
        queue: asyncio.Queue = asyncio.Queue()
        return StreamGenerateCall(self, self._open(queue, request, timeout_s, trace_context), queue)

    def abandon(self, call_id: int) -> None:
        """Forgets a call still in flight and tells the scheduler to drop it."""
        if self._calls.pop(call_id) is not None and self._call is not None:
            self._outbox.add(encode_cancel(call_id))

    async def close(self) -> None:
        if self._call is not None:
            self._broken(self._call, "the gateway is closing")

    # -- stream lifecycle ---------------------------------------------------------

    def _open(self, handler: Handler, request, timeout_s: float, trace_context: dict[str, str]) -> int:
        """Registers the call and queues its entry; returns its id.
        Raises AttemptError (nothing sent) when it has no time left or is too large for one message."""
        if timeout_s <= 0:
            raise AttemptError.local(UpstreamCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE)
        if self._call is None:
            self._start()
        elif not self._calls:
            self._heard_at_s = self._clock()  # silence counts from when there is something to hear
        call_id = self._calls.open(handler, timeout_s)
        record = encode_call(call_id, request, max(1, int(timeout_s * 1e6)), trace_context)
        if not self._outbox.fits(record):
            self._calls.pop(call_id)
            raise AttemptError.local(UpstreamCode.RESOURCE_EXHAUSTED, (
                f"request of {len(record)} bytes exceeds the {self._outbox.max_message_bytes}-byte message "
                f"limit of the stream to {self._address}"))
        self._outbox.add(record)
        deadline_s = self._calls.deadline_s(call_id)
        if deadline_s is not None and (self._timer_at_s is None or deadline_s < self._timer_at_s):
            self._arm(deadline_s)
        return call_id

    def _start(self) -> None:
        call = self._call = self._open_call()
        self._heard_at_s = self._clock()
        self._outbox.clear()
        # Opened by whichever request came first: the stream's tasks must not carry its log ids or span.
        self._tasks = (
            asyncio.create_task(self._read(call), name=f"submit-reader {self._address}", context=clean_context()),
            asyncio.create_task(self._write(call), name=f"submit-writer {self._address}", context=clean_context()),
        )

    def _broken(self, call: grpc.aio.StreamStreamCall | None, why: str, *, scheduler_silent: bool = False) -> None:
        """Fails every call in flight with UNAVAILABLE (no pushback); the next call opens a new stream.
        `scheduler_silent`: sever() gave up on it (AttemptError.scheduler_silent)."""
        if self._call is not call:
            return  # an older stream, already replaced
        self._call = None
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = ()
        if call is not None:  # None: no stream was open (self._call was None too)
            call.cancel()
        self._outbox.clear()
        self._disarm()
        failed = self._calls.pop_all()
        if failed:
            log.warning("Submit stream to %s broke with %d calls in flight: %s", self._address, len(failed), why)
        message = f"scheduler stream to {self._address} broke: {why}"
        for _, handler in failed:
            _fail(handler, AttemptError.local(UpstreamCode.UNAVAILABLE, message, scheduler_silent=scheduler_silent))

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        wake = self._wake
        try:
            while True:
                await wake.wait()
                wake.clear()
                while (message := self._outbox.take()) is not None:
                    await call.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._broken(call, await _why_write_failed(call, exc))

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            while (batch := await call.read()) is not grpc.aio.EOF:
                self._heard_at_s = self._clock()
                self._route(batch)
            self._broken(call, "the scheduler ended the stream")
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
            self._broken(call, _why(exc))
        except Exception as exc:  # a bug here must fail the calls now, not leave them to their deadlines
            log.exception("Submit reader for %s failed", self._address)
            self._broken(call, _why(exc))

    # -- replies -------------------------------------------------------------------

    def _route(self, batch: scheduler_pb2.ReplyBatch) -> None:
        calls = self._calls
        for reply in batch.replies:
            call_id = reply.call_id
            handler = calls.get(call_id)
            if handler is None:
                continue  # a call given up here (deadline, cancel) whose reply was already on its way
            kind = reply.WhichOneof("kind")
            if kind == "chunk" and isinstance(handler, asyncio.Queue):
                chunk = reply.chunk
                handler.put_nowait(chunk)
                if chunk.finish_reason:
                    calls.pop(call_id)
            elif kind == "classify" and not isinstance(handler, asyncio.Queue):
                calls.pop(call_id)
                if not handler.done():
                    handler.set_result(reply.classify)
            else:
                calls.pop(call_id)
                error = (AttemptError.from_call_error(reply.error) if kind == "error" else AttemptError.local(
                    UpstreamCode.INTERNAL, f"scheduler reply for call {call_id} is a {kind}, which that call cannot take"))
                _fail(handler, error)

    # -- deadlines ------------------------------------------------------------------

    def _arm(self, at_s: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        delay_s = max(0.0, at_s - self._clock())
        call_later = self._call_later or asyncio.get_running_loop().call_later
        self._timer = call_later(delay_s, self._on_timer)
        self._timer_at_s = at_s

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_at_s = None

    def _on_timer(self) -> None:
        self._timer = self._timer_at_s = None
        for call_id, handler in self._calls.pop_expired():
            _fail(handler, AttemptError.local(UpstreamCode.DEADLINE_EXCEEDED, DEADLINE_MESSAGE))
            if self._call is not None:
                self._outbox.add(encode_cancel(call_id))
        next_s = self._calls.next_deadline_s()
        if next_s is not None:
            self._arm(next_s)


def _fail(handler: Handler, error: AttemptError) -> None:
    if isinstance(handler, asyncio.Queue):
        handler.put_nowait(error)
    elif not handler.done():
        handler.set_exception(error)


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


async def _why_write_failed(call: grpc.aio.StreamStreamCall, exc: BaseException) -> str:
    """A write to a stream that had already ended (the scheduler died or closed it) fails with grpc's bare
    "RPC already finished"; the call's own status says why it ended, so that is what the log and the calls'
    errors carry."""
    if isinstance(exc, grpc.aio.AioRpcError) or not call.done():
        return _why(exc)
    code, details = await call.code(), await call.details()
    return f"{code.name}: {details}" if code is not None else _why(exc)
