"""A blocking client of Scheduler.Submit for tests: send entries, read replies per call."""

from __future__ import annotations

import queue
from collections import defaultdict

from infermesh.v1 import scheduler_pb2

_END = object()


class SubmitSession:
    """One Submit stream; `send` queues a SubmitBatch, `replies_until_done` reads until calls end."""

    def __init__(self, stub) -> None:
        self._outgoing: queue.Queue = queue.Queue()
        self.call = stub.Submit(self._requests())
        self.batches: list[scheduler_pb2.ReplyBatch] = []
        self.by_call: dict[int, list[scheduler_pb2.CallReply]] = defaultdict(list)

    def _requests(self):
        while (batch := self._outgoing.get()) is not _END:
            yield batch

    def send(self, *entries: scheduler_pb2.SubmitEntry) -> None:
        self._outgoing.put(scheduler_pb2.SubmitBatch(entries=entries))

    def read_batch(self) -> scheduler_pb2.ReplyBatch:
        batch = next(self.call)
        self.batches.append(batch)
        for reply in batch.replies:
            self.by_call[reply.call_id].append(reply)
        return batch

    def is_done(self, call_id: int) -> bool:
        replies = self.by_call.get(call_id)
        if not replies:
            return False
        last = replies[-1]
        kind = last.WhichOneof("kind")
        return kind in ("classify", "error") or (kind == "chunk" and last.chunk.finish_reason != 0)

    def replies_until_done(self, *call_ids: int) -> dict[int, list[scheduler_pb2.CallReply]]:
        while not all(self.is_done(call_id) for call_id in call_ids):
            self.read_batch()
        return {call_id: self.by_call[call_id] for call_id in call_ids}

    def close(self) -> None:
        self._outgoing.put(_END)
        self.call.cancel()


def classify_entry(call_id: int, request: scheduler_pb2.ScheduleClassifyRequest,
                   timeout_us: int = 10_000_000) -> scheduler_pb2.SubmitEntry:
    return scheduler_pb2.SubmitEntry(call_id=call_id, classify=request, timeout_us=timeout_us)


def generate_entry(call_id: int, request: scheduler_pb2.ScheduleGenerateRequest,
                   timeout_us: int = 10_000_000) -> scheduler_pb2.SubmitEntry:
    return scheduler_pb2.SubmitEntry(call_id=call_id, generate=request, timeout_us=timeout_us)


def generate_replies(stub, request: scheduler_pb2.ScheduleGenerateRequest) -> list[scheduler_pb2.CallReply]:
    """One Generate sent on a Submit session of its own: its replies until it ended."""
    session = SubmitSession(stub)
    try:
        session.send(generate_entry(1, request))
        return session.replies_until_done(1)[1]
    finally:
        session.close()


def cancel_entry(call_id: int) -> scheduler_pb2.SubmitEntry:
    return scheduler_pb2.SubmitEntry(call_id=call_id, cancel=scheduler_pb2.CancelCall())


def text_of(replies: list[scheduler_pb2.CallReply]) -> str:
    return "".join(reply.chunk.text for reply in replies if reply.WhichOneof("kind") == "chunk")
