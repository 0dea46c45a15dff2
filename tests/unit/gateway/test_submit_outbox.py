"""Submit entries encoded as SubmitBatch bytes, and the outbox that cuts them into messages."""

from __future__ import annotations

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.gateway.upstream.submit_outbox import EntryOutbox, encode_call, encode_cancel

TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


def test_encoded_entries_decode_as_the_entries_they_stand_for():
    classify = scheduler_pb2.ScheduleClassifyRequest(request=gateway_pb2.ClassifyRequest(
        model=common_pb2.ModelRef(name="digits"), image=common_pb2.Image(encoded=bytes(range(256)) * 600)))
    generate = scheduler_pb2.ScheduleGenerateRequest(request=gateway_pb2.GenerateRequest(prompt="héllo"))
    message = encode_call(1, classify, 250_000, TRACE) + encode_call(300, generate, 1, {}) + encode_cancel(1)

    entries = scheduler_pb2.SubmitBatch.FromString(message).entries
    assert entries[0] == scheduler_pb2.SubmitEntry(call_id=1, classify=classify, timeout_us=250_000,
                                                   trace_context=TRACE)
    assert entries[1] == scheduler_pb2.SubmitEntry(call_id=300, generate=generate, timeout_us=1)
    assert entries[2] == scheduler_pb2.SubmitEntry(call_id=1, cancel=scheduler_pb2.CancelCall())


def test_outbox_wakes_once_until_emptied_and_keeps_order():
    wakes = []
    outbox = EntryOutbox(1000, lambda: wakes.append(1))
    outbox.add(b"a")
    outbox.add(b"b")
    assert len(wakes) == 1
    assert outbox.take() == b"ab" and outbox.take() is None
    outbox.add(b"c")
    assert len(wakes) == 2


def test_outbox_cuts_messages_at_the_size_limit():
    outbox = EntryOutbox(10, lambda: None)
    for record in (b"1234", b"5678", b"90", b"abcdefgh", b"z"):
        outbox.add(record)
    assert [outbox.take(), outbox.take(), outbox.take()] == [b"1234567890", b"abcdefghz", None]
    assert not outbox.fits(b"x" * 11) and outbox.fits(b"x" * 10)


def test_clear_drops_what_was_not_sent():
    outbox = EntryOutbox(4, lambda: None)
    for record in (b"1234", b"5678"):
        outbox.add(record)
    outbox.clear()
    assert outbox.take() is None
