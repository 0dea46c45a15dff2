"""Stream coalescing: the decision (ChunkCoalescer) and its timer wiring (CoalescedEvents), on a fake clock."""

from __future__ import annotations

import pytest

from services.common import errors
from services.common.stream_options import (
    MAX_INTERVAL_MS,
    MAX_TOKENS_PER_CHUNK,
    StreamOptions,
    stream_options,
)
from services.scheduler.chunk_coalescer import ChunkCoalescer, CoalescedEvents
from services.scheduler.generate_stream import StreamEvent
from services.scheduler.sequence import FinishReason
from services.scheduler.step_plan import SequenceDelta
from tools.testbed.fake_clock import FakeClock

TEXT = "héllo, wörld! ok"


def deltas(n: int, finish: bool = True) -> list[SequenceDelta]:
    """One delta per token, like a decode loop; the last finishes the sequence (usage on it)."""
    out = []
    for i in range(n):
        last = finish and i == n - 1
        out.append(SequenceDelta(seq_id=7, token_ids=(100 + i,), text=TEXT[i % len(TEXT)], index=i,
                                 finish_reason=FinishReason.LENGTH if last else None,
                                 num_prompt_tokens=5, num_generated=i + 1))
    return out


def concat(chunks: list[SequenceDelta]) -> tuple[tuple[int, ...], str]:
    return tuple(t for c in chunks for t in c.token_ids), "".join(c.text for c in chunks)


def assert_indices_consistent(chunks: list[SequenceDelta]) -> None:
    seen = 0
    for chunk in chunks:
        assert chunk.index == seen
        seen += len(chunk.token_ids)


class TestOptions:
    def test_bounds_are_refused_with_field_value_and_range(self):
        with pytest.raises(errors.InvalidArgument, match=r"stream.max_tokens_per_chunk must be in \[0, 1024\], got 1025"):
            stream_options(MAX_TOKENS_PER_CHUNK + 1, 0)
        with pytest.raises(errors.InvalidArgument, match=r"stream.interval_ms must be in \[0, 5000\], got 5001"):
            stream_options(0, MAX_INTERVAL_MS + 1)
        assert stream_options(MAX_TOKENS_PER_CHUNK, MAX_INTERVAL_MS) == StreamOptions(1024, 5000)

    @pytest.mark.parametrize(("k", "interval_ms", "coalesces"),
                             [(0, 0, False), (1, 0, False), (1, 50, False), (4, 0, True), (0, 50, True), (8, 50, True)])
    def test_which_options_coalesce(self, k, interval_ms, coalesces):
        assert StreamOptions(k, interval_ms).coalesces is coalesces


class TestCount:
    def test_first_token_at_once_then_chunks_of_k_and_the_last_at_once(self):
        clock = FakeClock()
        coalescer = ChunkCoalescer(StreamOptions(max_tokens_per_chunk=4), clock)
        sent_per_push = [coalescer.push(d) for d in deltas(10)]
        chunks = [c for sent in sent_per_push for c in sent]
        assert [len(c.token_ids) for c in chunks] == [1, 4, 4, 1]
        assert len(sent_per_push[0]) == 1  # the first token is not held
        assert concat(chunks) == concat(deltas(10))
        assert_indices_consistent(chunks)
        last = chunks[-1]
        assert last.finish_reason is FinishReason.LENGTH
        assert (last.num_prompt_tokens, last.num_generated) == (5, 10)
        assert all(c.finish_reason is None for c in chunks[:-1])

    def test_a_step_that_would_overfill_sends_the_held_chunk_first(self):
        coalescer = ChunkCoalescer(StreamOptions(max_tokens_per_chunk=4), FakeClock())
        coalescer.push(SequenceDelta(seq_id=1, token_ids=(1,), text="a", index=0))
        assert coalescer.push(SequenceDelta(seq_id=1, token_ids=(2, 3), text="bc", index=1)) == []
        sent = coalescer.push(SequenceDelta(seq_id=1, token_ids=(4, 5, 6), text="def", index=3))
        assert [(c.token_ids, c.text, c.index) for c in sent] == [((2, 3), "bc", 1)]
        assert coalescer.num_pending_tokens == 3

    def test_count_alone_holds_without_a_timer(self):
        clock = FakeClock()
        coalescer = ChunkCoalescer(StreamOptions(max_tokens_per_chunk=4), clock)
        for d in deltas(3, finish=False):
            coalescer.push(d)
        clock.advance(60.0)
        assert coalescer.due_s is None and coalescer.take_due() is None
        assert coalescer.num_pending_tokens == 2

    def test_text_without_tokens_rides_with_the_next_token(self):
        coalescer = ChunkCoalescer(StreamOptions(max_tokens_per_chunk=4), FakeClock())
        assert coalescer.push(SequenceDelta(seq_id=1, token_ids=(), text="", index=0)) == []
        (first,) = coalescer.push(SequenceDelta(seq_id=1, token_ids=(9,), text="é", index=0))
        assert (first.token_ids, first.text, first.index) == ((9,), "é", 0)


class TestInterval:
    def test_a_chunk_per_interval_and_the_first_token_at_once(self):
        clock = FakeClock()
        coalescer = ChunkCoalescer(StreamOptions(interval_ms=50), clock)
        chunks = []
        for d in deltas(12):
            chunks += coalescer.push(d)
            clock.advance(0.0101)  # a token every ~10 ms (not exactly: no float ties with the interval)
        # t=0 first token; then a chunk when a token arrives >= 50 ms after the previous chunk; the last at once.
        assert [len(c.token_ids) for c in chunks] == [1, 5, 5, 1]
        assert concat(chunks) == concat(deltas(12))
        assert_indices_consistent(chunks)

    def test_held_tokens_go_when_due_without_another_step(self):
        clock = FakeClock()
        coalescer = ChunkCoalescer(StreamOptions(max_tokens_per_chunk=8, interval_ms=50), clock)
        first, second, third = deltas(3, finish=False)
        coalescer.push(first)
        clock.advance(0.005)
        coalescer.push(second)
        coalescer.push(third)
        assert coalescer.due_s == pytest.approx(1000.050)
        clock.advance(0.040)
        assert coalescer.take_due() is None  # 45 ms after the first chunk
        clock.advance(0.006)
        chunk = coalescer.take_due()
        assert (chunk.token_ids, chunk.index, chunk.text) == ((101, 102), 1, TEXT[1:3])
        assert coalescer.due_s is None  # nothing held, nothing due

    def test_an_error_end_takes_what_is_held(self):
        coalescer = ChunkCoalescer(StreamOptions(max_tokens_per_chunk=8), FakeClock())
        for d in deltas(3, finish=False):
            coalescer.push(d)
        held = coalescer.take_all()
        assert (held.token_ids, held.index) == ((101, 102), 1)
        assert coalescer.take_all() is None


class FakeTimers:
    """call_later on the fake clock: a test fires what is due by advancing it."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.armed: list[list] = []  # [due_s, callback, cancelled]

    def call_later(self, delay_s: float, callback):
        timer = [self.clock() + delay_s, callback, False]
        self.armed.append(timer)

        class Handle:
            def cancel(self_inner) -> None:
                timer[2] = True

        return Handle()

    def live(self) -> list[list]:
        return [t for t in self.armed if not t[2]]

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for timer in list(self.armed):
            if not timer[2] and timer[0] <= self.clock():
                timer[2] = True
                timer[1]()


class Sink:
    def __init__(self) -> None:
        self.events: list[StreamEvent] = []

    def put_nowait(self, event: StreamEvent) -> None:
        self.events.append(event)

    def chunks(self) -> list[SequenceDelta]:
        return [e.delta for e in self.events if e.delta is not None]


def coalesced(options: StreamOptions) -> tuple[CoalescedEvents, Sink, FakeTimers]:
    clock = FakeClock()
    timers = FakeTimers(clock)
    sink = Sink()
    return CoalescedEvents(sink, ChunkCoalescer(options, clock), clock, timers.call_later), sink, timers


class TestCoalescedEvents:
    def test_timer_flushes_a_sequence_that_makes_no_further_step(self):
        # E.g. preempted after its third token: nothing more comes from the pool for a while.
        events, sink, timers = coalesced(StreamOptions(max_tokens_per_chunk=16, interval_ms=50))
        for d in deltas(3, finish=False):
            events.put_nowait(StreamEvent(delta=d))
        assert [c.token_ids for c in sink.chunks()] == [(100,)]
        assert len(timers.live()) == 1
        timers.advance(0.049)
        assert len(sink.chunks()) == 1
        timers.advance(0.002)
        assert [(c.token_ids, c.index) for c in sink.chunks()] == [((100,), 0), ((101, 102), 1)]
        assert timers.live() == []  # nothing held: no timer armed

    def test_the_last_chunk_goes_at_once_and_disarms_the_timer(self):
        events, sink, timers = coalesced(StreamOptions(interval_ms=50))
        for d in deltas(4):
            events.put_nowait(StreamEvent(delta=d))
        assert [len(c.token_ids) for c in sink.chunks()] == [1, 3]
        assert sink.chunks()[-1].is_last
        assert timers.live() == []

    def test_an_error_follows_the_held_tokens_and_disarms_the_timer(self):
        events, sink, timers = coalesced(StreamOptions(max_tokens_per_chunk=8, interval_ms=50))
        for d in deltas(3, finish=False):
            events.put_nowait(StreamEvent(delta=d))
        failure = errors.Internal("worker failed")
        events.put_nowait(StreamEvent(error=failure))
        assert [e.delta.token_ids if e.delta else e.error for e in sink.events] == [(100,), (101, 102), failure]
        assert timers.live() == []

    def test_close_disarms_the_timer(self):
        events, sink, timers = coalesced(StreamOptions(interval_ms=50))
        for d in deltas(2, finish=False):
            events.put_nowait(StreamEvent(delta=d))
        events.close()
        timers.advance(1.0)
        assert [c.token_ids for c in sink.chunks()] == [(100,)]

    def test_a_timer_that_fires_early_rearms(self):
        events, sink, timers = coalesced(StreamOptions(interval_ms=50))
        for d in deltas(2, finish=False):
            events.put_nowait(StreamEvent(delta=d))
        (timer,) = timers.live()
        timer[2] = True
        timer[1]()  # the event loop ran it a little before the clock reached it
        assert len(sink.chunks()) == 1
        (rearmed,) = timers.live()
        assert rearmed[0] == pytest.approx(1000.050)
