"""SchedulerStream over a fake Submit call: coalescing, routing, deadlines (fake clock), breaks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common import errors
from services.gateway.upstream.attempt_error import AttemptError
from services.gateway.upstream.scheduler_stream import DEADLINE_MESSAGE, SchedulerStream
from services.gateway.upstream.status import UpstreamCode

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


class FakeSubmitCall:
    """What stub.Submit() returns, scripted: replies are queued by the test."""

    def __init__(self) -> None:
        self.written: list[scheduler_pb2.SubmitBatch] = []
        self._incoming: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    async def write(self, message: bytes) -> None:
        self.written.append(scheduler_pb2.SubmitBatch.FromString(message))

    async def read(self):
        item = await self._incoming.get()
        if isinstance(item, Exception):
            raise item
        return item

    def reply(self, *replies: scheduler_pb2.CallReply) -> None:
        self._incoming.put_nowait(scheduler_pb2.ReplyBatch(replies=replies))

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        self._incoming.put_nowait(grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details))

    def cancel(self) -> None:
        self.cancelled = True

    # The call's end, as grpc.aio reports it once the RPC has finished (finished_with sets it).
    status: tuple[grpc.StatusCode, str] | None = None

    def done(self) -> bool:
        return self.status is not None

    async def code(self) -> grpc.StatusCode | None:
        return None if self.status is None else self.status[0]

    async def details(self) -> str | None:
        return None if self.status is None else self.status[1]

    def entries(self) -> list[scheduler_pb2.SubmitEntry]:
        return [entry for batch in self.written for entry in batch.entries]


class FakeTimers:
    """call_later on the fake clock: `fire_due()` runs what is due."""

    def __init__(self, clock) -> None:
        self._clock = clock
        self._timers: list[tuple[float, object, asyncio.Handle]] = []

    def call_later(self, delay_s: float, callback):
        handle = asyncio.Handle(callback, (), asyncio.get_running_loop())
        self._timers.append((self._clock() + delay_s, callback, handle))
        return handle

    def fire_due(self) -> None:
        due = [(at_s, cb, h) for at_s, cb, h in self._timers if at_s <= self._clock() and not h.cancelled()]
        self._timers = [t for t in self._timers if t not in due]
        for _, callback, _ in due:
            callback()


@pytest.fixture
def calls() -> list[FakeSubmitCall]:
    return []


@pytest.fixture
def stream(clock, calls) -> SchedulerStream:
    def open_call() -> FakeSubmitCall:
        calls.append(FakeSubmitCall())
        return calls[-1]

    stream = SchedulerStream("sched:1", open_call, 4096, clock)
    stream.timers = FakeTimers(clock)
    stream._call_later = stream.timers.call_later
    return stream


async def settle() -> None:
    """Lets the stream's reader and writer run (no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


def classify_request() -> scheduler_pb2.ScheduleClassifyRequest:
    return scheduler_pb2.ScheduleClassifyRequest(request=gateway_pb2.ClassifyRequest(top_k=1))


def generate_request() -> scheduler_pb2.ScheduleGenerateRequest:
    return scheduler_pb2.ScheduleGenerateRequest(request=gateway_pb2.GenerateRequest(prompt="abc"))


def chunk_reply(call_id: int, index: int, last: bool = False) -> scheduler_pb2.CallReply:
    chunk = gateway_pb2.GenerateResponse(token_ids=[index], index=index,
                                         finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)
    return scheduler_pb2.CallReply(call_id=call_id, chunk=chunk)


async def read_all(call) -> list:
    return [chunk async for chunk in call.chunks()]


async def test_calls_made_in_one_turn_go_out_as_one_message(stream, calls):
    first = asyncio.create_task(stream.classify(classify_request(), 2.0, TRACE))
    second = asyncio.create_task(stream.classify(classify_request(), 0.5, {}))
    await settle()
    stream.generate(generate_request(), 1.0, TRACE)
    await settle()

    (call,) = calls
    assert [len(batch.entries) for batch in call.written] == [2, 1]
    entries = call.entries()
    assert [e.call_id for e in entries] == [1, 2, 3]
    assert [e.WhichOneof("kind") for e in entries] == ["classify", "classify", "generate"]
    assert [e.timeout_us for e in entries] == [2_000_000, 500_000, 1_000_000]
    assert dict(entries[0].trace_context) == TRACE and not entries[1].trace_context
    first.cancel(), second.cancel()


async def test_replies_reach_their_own_calls(stream, calls):
    classify = asyncio.create_task(stream.classify(classify_request(), 2.0, {}))
    await settle()
    generate = stream.generate(generate_request(), 2.0, {})
    reading = asyncio.create_task(read_all(generate))
    await settle()
    calls[0].reply(chunk_reply(2, 0), scheduler_pb2.CallReply(
        call_id=1, classify=gateway_pb2.ClassifyResponse(request_id="r1")))
    calls[0].reply(chunk_reply(2, 1), chunk_reply(2, 2, last=True), chunk_reply(99, 0))

    assert (await classify).request_id == "r1"
    assert [chunk.index for chunk in await reading] == [0, 1, 2]
    assert stream.num_calls == 0


async def test_a_call_error_keeps_the_schedulers_code_message_and_pushback(stream, calls):
    classify = asyncio.create_task(stream.classify(classify_request(), 2.0, {}))
    await settle()
    generate = stream.generate(generate_request(), 2.0, {})
    reading = asyncio.create_task(read_all(generate))
    await settle()
    busy = scheduler_pb2.CallError(code=grpc.StatusCode.UNAVAILABLE.value[0], message="no worker serves model m:1",
                                   retry_pushback_ms=1000)
    bad = scheduler_pb2.CallError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="prompt must not be empty")
    calls[0].reply(scheduler_pb2.CallReply(call_id=1, error=busy), scheduler_pb2.CallReply(call_id=2, error=bad))

    with pytest.raises(AttemptError) as unavailable:
        await classify
    assert (unavailable.value.code, unavailable.value.pushback_ms) == (UpstreamCode.UNAVAILABLE, 1000)
    assert isinstance(unavailable.value.error, errors.Unavailable)
    assert unavailable.value.error.retry_after_s == 1.0 and unavailable.value.answered_by_scheduler
    with pytest.raises(AttemptError) as invalid:
        await reading
    assert (invalid.value.code, invalid.value.pushback_ms) == (UpstreamCode.INVALID_ARGUMENT, None)
    assert invalid.value.error.message == "prompt must not be empty"


async def test_a_call_past_its_deadline_fails_here_and_is_cancelled_upstream(stream, calls, clock):
    slow = asyncio.create_task(stream.classify(classify_request(), 0.5, {}))
    patient = asyncio.create_task(stream.classify(classify_request(), 5.0, {}))
    await settle()
    clock.advance(0.49)
    stream.timers.fire_due()
    await settle()
    assert not slow.done()
    clock.advance(0.02)
    stream.timers.fire_due()
    await settle()

    with pytest.raises(AttemptError) as caught:
        await slow
    assert (caught.value.code, caught.value.pushback_ms) == (UpstreamCode.DEADLINE_EXCEEDED, None)
    assert caught.value.error.message == DEADLINE_MESSAGE
    assert [(e.call_id, e.WhichOneof("kind")) for e in calls[0].written[-1].entries] == [(1, "cancel")]
    calls[0].reply(scheduler_pb2.CallReply(call_id=1, classify=gateway_pb2.ClassifyResponse()))
    await settle()
    assert not patient.done(), "the late reply for the expired call went nowhere"
    patient.cancel()


async def test_a_broken_stream_fails_every_call_unavailable_without_pushback_and_the_next_call_reopens(
        stream, calls):
    classify = asyncio.create_task(stream.classify(classify_request(), 2.0, {}))
    await settle()
    generate = stream.generate(generate_request(), 2.0, {})
    reading = asyncio.create_task(read_all(generate))
    await settle()
    calls[0].fail(grpc.StatusCode.UNAVAILABLE, "Socket closed")
    await settle()

    for task in (classify, reading):
        with pytest.raises(AttemptError) as caught:
            await task
        assert (caught.value.code, caught.value.pushback_ms) == (UpstreamCode.UNAVAILABLE, None)
        assert not caught.value.answered_by_scheduler
        assert caught.value.error.message == "scheduler stream to sched:1 broke: UNAVAILABLE: Socket closed"
    assert calls[0].cancelled and stream.num_calls == 0

    again = asyncio.create_task(stream.classify(classify_request(), 2.0, {}))
    await settle()
    assert len(calls) == 2 and [e.call_id for e in calls[1].entries()] == [3]
    calls[1].reply(scheduler_pb2.CallReply(call_id=3, classify=gateway_pb2.ClassifyResponse(request_id="r3")))
    assert (await again).request_id == "r3"


async def test_a_write_to_a_stream_that_already_ended_fails_the_calls_with_the_streams_own_status(stream, calls):
    """The scheduler died with the stream's status already in (grpc then answers a write with a bare "RPC already
    finished"): the calls' errors, and the log, say why the stream ended instead."""
    classify = asyncio.create_task(stream.classify(classify_request(), 2.0, {}))
    await settle()

    async def refuse(message: bytes) -> None:
        raise asyncio.InvalidStateError("RPC already finished.")

    calls[0].status = (grpc.StatusCode.UNAVAILABLE, "Socket closed")
    calls[0].write = refuse
    stream.generate(generate_request(), 2.0, {})
    await settle()

    with pytest.raises(AttemptError) as caught:
        await classify
    assert caught.value.code == UpstreamCode.UNAVAILABLE
    assert caught.value.error.message == "scheduler stream to sched:1 broke: UNAVAILABLE: Socket closed"
    assert stream.num_calls == 0


async def test_cancelling_a_generate_call_sends_a_cancel_entry_once(stream, calls):
    call = stream.generate(generate_request(), 2.0, {})
    await settle()
    call.cancel()
    call.cancel()
    await settle()
    assert [(e.call_id, e.WhichOneof("kind")) for e in calls[0].entries()] == [(1, "generate"), (1, "cancel")]
    assert stream.num_calls == 0


async def test_a_reply_of_the_wrong_kind_fails_that_call_alone(stream, calls):
    generate = stream.generate(generate_request(), 2.0, {})
    reading = asyncio.create_task(read_all(generate))
    await settle()
    calls[0].reply(scheduler_pb2.CallReply(call_id=1, classify=gateway_pb2.ClassifyResponse()))
    with pytest.raises(AttemptError) as caught:
        await reading
    assert caught.value.code == UpstreamCode.INTERNAL
    assert caught.value.error.message == "scheduler reply for call 1 is a classify, which that call cannot take"


async def test_an_abandoned_classify_is_cancelled_upstream(stream, calls):
    classify = asyncio.create_task(stream.classify(classify_request(), 2.0, {}))
    await settle()
    classify.cancel()
    await settle()
    assert [e.WhichOneof("kind") for e in calls[0].entries()] == ["classify", "cancel"]
    assert stream.num_calls == 0


async def test_entries_beyond_the_message_limit_go_in_several_messages_and_an_oversized_call_fails_alone(
        stream, calls):
    image = common_pb2.Image(encoded=bytes(1500))
    request = scheduler_pb2.ScheduleClassifyRequest(request=gateway_pb2.ClassifyRequest(image=image))
    tasks = [asyncio.create_task(stream.classify(request, 2.0, {})) for _ in range(5)]
    await settle()
    assert [len(batch.entries) for batch in calls[0].written] == [2, 2, 1]
    assert [e.call_id for e in calls[0].entries()] == [1, 2, 3, 4, 5]
    assert calls[0].entries()[0].classify == request

    huge = scheduler_pb2.ScheduleClassifyRequest(request=gateway_pb2.ClassifyRequest(
        image=common_pb2.Image(encoded=bytes(5000))))
    with pytest.raises(AttemptError) as caught:
        await stream.classify(huge, 2.0, {})
    assert (caught.value.code, caught.value.pushback_ms) == (UpstreamCode.RESOURCE_EXHAUSTED, None)
    assert caught.value.error.message.startswith("request of 50")
    assert stream.num_calls == 5
    for task in tasks:
        task.cancel()
