"""One Submit stream: many gateway calls multiplexed on one bidirectional gRPC stream.

The stream owns three things: the call table (call_id -> the task serving that
call), the outbox (replies made in one event-loop turn, sent as one
ReplyBatch), and the writer task that drains it. What a call does (validation,
tenant, deadline, pool submit, building the reply) is the servicer's core, the
same code the unary Classify and Generate run; this module only routes entries
in and replies out.

Invariants: a call's replies leave in the order it made them; after a call's
last reply (classify response, last chunk, or error) its call_id is gone from
the table; when the stream ends, every call still in the table is cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.common import errors
from services.common.status import status_code_of
from services.scheduler.in_flight import draining_error

log = logging.getLogger(__name__)


class SubmitCore(Protocol):
    """The servicer's per-kind cores, driven here with the stream's delivery."""

    def classify_call(self, request: scheduler_pb2.ScheduleClassifyRequest, carrier: dict[str, str],
                      remaining_s: float | None,
                      respond: Callable[[], gateway_pb2.ClassifyResponse]) -> Coroutine[Any, Any, None]: ...

    def generate_call(self, request: scheduler_pb2.ScheduleGenerateRequest, carrier: dict[str, str],
                      remaining_s: float | None,
                      next_chunk: Callable[[], gateway_pb2.GenerateResponse]) -> Coroutine[Any, Any, None]: ...


class ReplyOutbox:
    """Replies made since the last send, built in place in the next ReplyBatch.

    `wake` runs once per batch, when its first reply is added: the writer then sends
    everything added before it gets to run (the rest of this event-loop turn) as one
    message, e.g. the chunks of all of this stream's sequences from one engine step.
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._batch = scheduler_pb2.ReplyBatch()

    def add(self, call_id: int) -> scheduler_pb2.CallReply:
        """A new reply for call_id, to fill in before control returns to the event loop."""
        replies = self._batch.replies
        if not replies:
            self._wake()
        return replies.add(call_id=call_id)

    @property
    def empty(self) -> bool:
        return not self._batch.replies

    def take(self) -> scheduler_pb2.ReplyBatch | None:
        """The batch to send now (None when empty); later replies start a new one."""
        if not self._batch.replies:
            return None
        batch, self._batch = self._batch, scheduler_pb2.ReplyBatch()
        return batch


def within_size(batch: scheduler_pb2.ReplyBatch, max_message_bytes: int) -> list[scheduler_pb2.ReplyBatch]:
    """batch as messages of at most max_message_bytes (the gateway's receive limit, assumed equal to ours):
    one message too large would break the stream and every call on it. A single reply over the limit
    becomes that call's RESOURCE_EXHAUSTED error."""
    if batch.ByteSize() <= max_message_bytes:
        return [batch]
    out = [scheduler_pb2.ReplyBatch()]
    num_bytes = 0
    for reply in batch.replies:
        size = reply.ByteSize() + 8  # + the field's tag and length
        if size > max_message_bytes:
            too_large = errors.ResourceExhausted(
                f"reply of {size} bytes exceeds the {max_message_bytes}-byte message limit of the stream")
            reply = scheduler_pb2.CallReply(call_id=reply.call_id)
            fill_error(reply, too_large)
            size = reply.ByteSize() + 8
        if num_bytes + size > max_message_bytes and out[-1].replies:
            out.append(scheduler_pb2.ReplyBatch())
            num_bytes = 0
        out[-1].replies.append(reply)
        num_bytes += size
    return out


def fill_error(reply: scheduler_pb2.CallReply, exc: BaseException) -> None:
    """The CallError the unary RPC would end with (see status.maps_domain_errors)."""
    error = reply.error
    if isinstance(exc, errors.InfermeshError):
        error.code = status_code_of(exc).value[0]
        error.message = exc.message
        retry_after_s = getattr(exc, "retry_after_s", None)
        if retry_after_s is not None:
            error.retry_pushback_ms = int(retry_after_s * 1000)
    else:
        error.code = status_code_of(errors.Internal("")).value[0]
        error.message = f"internal error: {type(exc).__name__}"


class SubmitStream:
    """The call table and outbox of one Submit stream; `serve` runs it until the stream ends."""

    def __init__(self, core: SubmitCore, max_message_bytes: int) -> None:
        self._core = core
        self._max_message_bytes = max_message_bytes
        self._calls: dict[int, asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._draining = False
        self.outbox = ReplyOutbox(self._wake.set)

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    async def serve(self, read: Callable[[], Awaitable[scheduler_pb2.SubmitBatch | None]],
                    write: Callable[[scheduler_pb2.ReplyBatch], Awaitable[None]]) -> None:
        """Runs until `read` gives None (the gateway closed its side or the stream failed), or, once
        draining, until the last call's replies are sent; then cancels every call still running."""
        reader = asyncio.create_task(self._read(read))
        writer = asyncio.create_task(self._write(write))
        try:
            await asyncio.wait((reader, writer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            reader.cancel()
            writer.cancel()
            self.cancel_all()

    def drain(self) -> None:
        """The scheduler is stopping: refuse new calls (UNAVAILABLE, pushback 0 ms: no work was done, the
        gateway retries elsewhere at once) and end the stream when the calls in flight are done."""
        self._draining = True
        self._wake.set()

    def on_entry(self, entry: scheduler_pb2.SubmitEntry) -> None:
        kind = entry.WhichOneof("kind")
        call_id = entry.call_id
        if kind == "cancel":
            task = self._calls.pop(call_id, None)
            if task is not None:
                task.cancel()
                self._wake_if_drained()
            return
        if kind is None or call_id == 0 or call_id in self._calls:
            self._fail(call_id, errors.InvalidArgument(_bad_entry_message(kind, call_id)))
            return
        if self._draining:
            self._fail(call_id, draining_error("call another scheduler"))
            return
        remaining_s = entry.timeout_us / 1e6 if entry.timeout_us else None
        carrier = dict(entry.trace_context)
        if kind == "classify":
            work = self._core.classify_call(entry.classify, carrier, remaining_s, self._responder(call_id, "classify"))
        else:
            work = self._core.generate_call(entry.generate, carrier, remaining_s, self._responder(call_id, "chunk"))
        task = asyncio.create_task(work)
        self._calls[call_id] = task
        task.add_done_callback(functools.partial(self._finished, call_id))

    def cancel_all(self) -> None:
        calls, self._calls = self._calls, {}
        for task in calls.values():
            task.cancel()

    # -- internals ---------------------------------------------------------

    def _responder(self, call_id: int, field: str):
        add = self.outbox.add

        def next_reply():
            return getattr(add(call_id), field)

        return next_reply

    def _finished(self, call_id: int, task: asyncio.Task) -> None:
        if self._calls.get(call_id) is not task:
            return  # cancelled by the gateway or the stream's end: no reply is owed
        del self._calls[call_id]
        self._wake_if_drained()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            if not isinstance(exc, errors.InfermeshError):
                log.error("unhandled error in Submit call %d", call_id, exc_info=exc)
            fill_error(self.outbox.add(call_id), exc)

    def _fail(self, call_id: int, exc: errors.InfermeshError) -> None:
        fill_error(self.outbox.add(call_id), exc)

    def _wake_if_drained(self) -> None:
        if self._draining and not self._calls:
            self._wake.set()  # the writer sends what is left, then ends the stream

    async def _read(self, read: Callable[[], Awaitable[scheduler_pb2.SubmitBatch | None]]) -> None:
        while (batch := await read()) is not None:
            for entry in batch.entries:
                self.on_entry(entry)

    async def _write(self, write: Callable[[scheduler_pb2.ReplyBatch], Awaitable[None]]) -> None:
        wake = self._wake
        while True:
            await wake.wait()
            wake.clear()
            batch = self.outbox.take()
            if batch is not None:
                try:
                    for message in within_size(batch, self._max_message_bytes):
                        await write(message)
                except Exception as exc:  # noqa: BLE001 - the stream is gone; serve() ends it
                    log.info("Submit stream write failed: %s", exc)
                    return
            if self._draining and not self._calls and self.outbox.empty:
                return


def _bad_entry_message(kind: str | None, call_id: int) -> str:
    if call_id == 0:
        return "entry.call_id must be >= 1"
    if kind is None:
        return f"entry {call_id} has none of classify, generate or cancel"
    return f"call_id {call_id} is already in flight on this stream"
