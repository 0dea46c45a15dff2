"""ClientStreams alone: chunks to their streams, and how each way a stream ends is reported."""

from __future__ import annotations

import pytest

from services.common import errors
from services.scheduler.attach_types import ModelKey
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_stream import ClientStreams, GenerateStream
from services.scheduler.sequence import AbortReason, FinishReason
from services.scheduler.step_plan import SequenceDelta, StepPlan


class ListSink(list):
    def put_nowait(self, event) -> None:
        self.append(event)


def make_streams(clock) -> tuple[ClientStreams, list[int]]:
    ended: list[int] = []
    return ClientStreams(ModelKey("test-streams", "1"), clock, on_ended=ended.append), ended


def open_stream(streams: ClientStreams, clock, seq_id: int) -> GenerateStream:
    stream = GenerateStream(seq_id=seq_id, tenant=TenantContext("t"), seed=0, trace_context={},
                            arrival_s=clock(), deadline_s=None, events=ListSink())
    streams.add(stream)
    return stream


def delta(seq_id: int, index: int, text: str, **over) -> SequenceDelta:
    return SequenceDelta(seq_id=seq_id, token_ids=tuple(text.encode()), text=text, index=index, **over)


def test_chunks_reach_their_stream_and_the_last_one_ends_it(clock):
    streams, ended = make_streams(clock)
    stream = open_stream(streams, clock, 1)
    streams.deliver([delta(1, 0, "ab")], {})
    clock.advance(0.01)
    streams.deliver([delta(1, 2, "c", finish_reason=FinishReason.LENGTH)], {})
    assert [event.delta.text for event in stream.events] == ["ab", "c"]
    assert stream.finished and 1 not in streams and ended == [1]


def test_a_sequence_the_worker_failed_ends_with_its_reason(clock):
    streams, ended = make_streams(clock)
    named, unnamed = open_stream(streams, clock, 1), open_stream(streams, clock, 2)
    failed = dict(abort_reason=AbortReason.FAILED)
    streams.deliver([delta(1, 0, "", **failed), delta(2, 0, "", **failed)], {1: errors.Internal("NaN in logits")})
    assert isinstance(named.events[-1].error, errors.Internal)
    assert "NaN in logits" in str(named.events[-1].error)
    assert "the worker returned no valid token" in str(unnamed.events[-1].error)
    assert ended == [1, 2]


def test_a_sequence_failed_for_its_callers_request_ends_with_that_invalid_argument(clock):
    """The worker's INVALID_ARGUMENT naming a request field (a grammar that forces an endless sequence)
    reaches the client as it is; any other INVALID_ARGUMENT (a block table the worker refused) is ours."""
    streams, _ = make_streams(clock)
    callers, ours = open_stream(streams, clock, 1), open_stream(streams, clock, 2)
    failed = dict(abort_reason=AbortReason.FAILED)
    streams.deliver([delta(1, 0, "", **failed), delta(2, 0, "", **failed)], {
        1: errors.InvalidArgument("sampling.structured: the grammar cannot go on"),
        2: errors.InvalidArgument("sequence 2: block table of 1 blocks holds 4 positions")})
    assert isinstance(callers.events[-1].error, errors.InvalidArgument)
    assert str(callers.events[-1].error) == "sampling.structured: the grammar cannot go on"
    assert isinstance(ours.events[-1].error, errors.Internal) and "block table" in str(ours.events[-1].error)


def test_an_expired_sequence_ends_with_deadline_exceeded_and_a_closed_one_is_not_reported(clock):
    streams, ended = make_streams(clock)
    expired, closed = open_stream(streams, clock, 1), open_stream(streams, clock, 2)
    assert streams.close(2) and not streams.close(2)
    streams.planned(StepPlan(step_id=1, seqs=(), finished_seq_ids=(), expired_seq_ids=(1, 2)))
    with pytest.raises(errors.DeadlineExceeded, match="waiting for admission"):
        raise expired.events[-1].error
    assert closed.events == [] and ended == [1]
