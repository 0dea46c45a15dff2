"""SubmitStream with a scripted core: call table, cancel, per-turn reply batches, drain."""

from __future__ import annotations

import asyncio

import pytest

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.common import errors
from services.scheduler.submit_stream import ReplyOutbox, SubmitStream, fill_error, within_size


class ScriptedCore:
    """Classify answers when the test resolves its future; generate emits what the test pushes."""

    def __init__(self) -> None:
        self.classify_results: dict[str, asyncio.Future] = {}
        self.chunk_makers: dict[str, object] = {}
        self.ends: dict[str, asyncio.Future] = {}
        self.cancelled: list[str] = []
        self.remaining_s: dict[str, float | None] = {}

    async def classify_call(self, request, carrier, remaining_s, respond) -> None:
        request_id = request.request.request_id
        self.remaining_s[request_id] = remaining_s
        future = self.classify_results[request_id] = asyncio.get_running_loop().create_future()
        try:
            labels = await future
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        respond().labels.add(label=labels)

    async def generate_call(self, request, carrier, remaining_s, next_chunk) -> None:
        request_id = request.request.request_id
        self.chunk_makers[request_id] = next_chunk
        end = self.ends[request_id] = asyncio.get_running_loop().create_future()
        try:
            await end
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


class Pipe:
    """Both ends of the fake gRPC stream."""

    def __init__(self) -> None:
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.sent: list[scheduler_pb2.ReplyBatch] = []

    async def read(self):
        return await self.incoming.get()

    async def write(self, batch) -> None:
        self.sent.append(batch)

    def send(self, *entries) -> None:
        self.incoming.put_nowait(scheduler_pb2.SubmitBatch(entries=entries))

    def replies(self) -> list[tuple[int, str]]:
        return [(r.call_id, r.WhichOneof("kind")) for batch in self.sent for r in batch.replies]


def classify(call_id: int, request_id: str, timeout_us: int = 0) -> scheduler_pb2.SubmitEntry:
    request = scheduler_pb2.ScheduleClassifyRequest(request=gateway_pb2.ClassifyRequest(request_id=request_id))
    return scheduler_pb2.SubmitEntry(call_id=call_id, classify=request, timeout_us=timeout_us)


def generate(call_id: int, request_id: str) -> scheduler_pb2.SubmitEntry:
    request = scheduler_pb2.ScheduleGenerateRequest(request=gateway_pb2.GenerateRequest(request_id=request_id))
    return scheduler_pb2.SubmitEntry(call_id=call_id, generate=request)


def cancel(call_id: int) -> scheduler_pb2.SubmitEntry:
    return scheduler_pb2.SubmitEntry(call_id=call_id, cancel=scheduler_pb2.CancelCall())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.fixture
async def running():
    core, pipe = ScriptedCore(), Pipe()
    stream = SubmitStream(core, 1 << 20)
    serving = asyncio.create_task(stream.serve(pipe.read, pipe.write))
    yield core, pipe, stream, serving
    pipe.incoming.put_nowait(None)
    await serving


def test_outbox_wakes_the_writer_once_per_batch():
    wakes = []
    outbox = ReplyOutbox(lambda: wakes.append(1))
    outbox.add(1).chunk.index = 0
    outbox.add(2).chunk.index = 0
    assert len(wakes) == 1
    batch = outbox.take()
    assert [r.call_id for r in batch.replies] == [1, 2] and outbox.take() is None
    outbox.add(3)
    assert len(wakes) == 2


def test_errors_keep_the_status_message_and_retry_hint_of_the_unary_rpc():
    reply = scheduler_pb2.CallReply()
    fill_error(reply, errors.Unavailable("no worker serves model m:1", retry_after_s=1.0))
    assert (reply.error.code, reply.error.message, reply.error.retry_pushback_ms) == (14, "no worker serves model m:1", 1000)
    reply = scheduler_pb2.CallReply()
    fill_error(reply, errors.InvalidArgument("prompt must not be empty"))
    assert (reply.error.code, reply.error.HasField("retry_pushback_ms")) == (3, False)
    reply = scheduler_pb2.CallReply()
    fill_error(reply, KeyError("x"))
    assert (reply.error.code, reply.error.message) == (13, "internal error: KeyError")


async def test_chunks_of_many_calls_made_in_one_turn_leave_as_one_message(running):
    core, pipe, _, _ = running
    pipe.send(generate(1, "a"), generate(2, "b"))
    await settle()
    for request_id in ("a", "b"):  # one engine step delivers both sequences' chunks
        core.chunk_makers[request_id]().index = 7
    await settle()
    assert [[r.call_id for r in batch.replies] for batch in pipe.sent] == [[1, 2]]


async def test_a_failing_call_gets_its_error_and_the_others_carry_on(running):
    core, pipe, stream, _ = running
    pipe.send(classify(1, "ok", timeout_us=250_000), classify(2, "bad"))
    await settle()
    assert core.remaining_s == {"ok": 0.25, "bad": None}
    core.classify_results["bad"].set_exception(errors.NotFound("model x:1 is not served here"))
    core.classify_results["ok"].set_result("bright")
    await settle()
    by_call = {r.call_id: r for batch in pipe.sent for r in batch.replies}
    assert by_call[1].classify.labels[0].label == "bright"
    assert (by_call[2].error.code, by_call[2].error.message) == (5, "model x:1 is not served here")
    assert stream.num_calls == 0


async def test_cancel_entry_cancels_the_call_and_no_reply_follows(running):
    core, pipe, stream, _ = running
    pipe.send(generate(1, "a"))
    await settle()
    pipe.send(cancel(1), cancel(99))
    await settle()
    assert core.cancelled == ["a"] and stream.num_calls == 0 and pipe.replies() == []


async def test_bad_entries_fail_alone(running):
    _, pipe, stream, _ = running
    pipe.send(classify(1, "a"), classify(1, "dup"), scheduler_pb2.SubmitEntry(call_id=2), classify(0, "zero"))
    await settle()
    messages = {r.call_id: r.error.message for batch in pipe.sent for r in batch.replies}
    assert messages == {1: "call_id 1 is already in flight on this stream",
                        2: "entry 2 has none of classify, generate or cancel",
                        0: "entry.call_id must be >= 1"}
    assert stream.num_calls == 1


async def test_the_end_of_the_stream_cancels_every_call():
    core, pipe = ScriptedCore(), Pipe()
    serving = asyncio.create_task(SubmitStream(core, 1 << 20).serve(pipe.read, pipe.write))
    pipe.send(classify(1, "a"), generate(2, "b"))
    await settle()
    pipe.incoming.put_nowait(None)
    await serving
    await settle()
    assert sorted(core.cancelled) == ["a", "b"]


async def test_draining_refuses_new_calls_and_ends_after_the_last_reply():
    core, pipe = ScriptedCore(), Pipe()
    stream = SubmitStream(core, 1 << 20)
    serving = asyncio.create_task(stream.serve(pipe.read, pipe.write))
    pipe.send(classify(1, "a"))
    await settle()
    stream.drain()
    pipe.send(classify(2, "late"))
    await settle()
    assert not serving.done()
    core.classify_results["a"].set_result("dark")
    await asyncio.wait_for(serving, timeout=5)
    replies = {r.call_id: r for batch in pipe.sent for r in batch.replies}
    assert replies[1].classify.labels[0].label == "dark"
    assert (replies[2].error.code, replies[2].error.message) == (14, "scheduler draining: call another scheduler")
    assert replies[2].error.retry_pushback_ms == 0  # no work was done: retry elsewhere at once


def test_a_batch_over_the_message_limit_is_cut_and_an_oversized_reply_becomes_its_error():
    batch = scheduler_pb2.ReplyBatch()
    for call_id in (1, 2, 3):
        batch.replies.add(call_id=call_id).chunk.text = "x" * 300
    batch.replies.add(call_id=4).chunk.text = "y" * 5000
    assert within_size(batch, 10_000) == [batch]

    messages = within_size(batch, 1000)
    assert [[r.call_id for r in m.replies] for m in messages] == [[1, 2, 3], [4]]
    assert all(m.ByteSize() <= 1000 for m in messages)
    assert messages[0].replies[0].chunk.text == "x" * 300
    error = messages[1].replies[0].error
    assert error.code == 8 and error.message.endswith("exceeds the 1000-byte message limit of the stream")
