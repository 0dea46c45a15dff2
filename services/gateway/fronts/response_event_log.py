"""One background Response's streamed events, kept so that a client can read them from any point:
the POST that created it follows them from the start, and `GET /v1/responses/{id}?stream=true
&starting_after=N` from after event N, however often it reconnects. Pure: no I/O (waiting for the
next event is an asyncio.Event, nothing more).

Bounded: the log keeps at most `max_bytes` of encoded events (the store's bound: no Response is kept
larger). Past it the oldest are dropped, and a reader asking for one of those is told so
(EventsGone): it never gets a stream with a hole in it. Every event is kept whole or not at all.

Invariant: the kept events' sequence numbers run without a gap from `first_kept` to `next_sequence - 1`,
and `num_bytes` is the sum of their sizes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Iterable
from itertools import islice


class EventsGone(Exception):
    """The events after `starting_after` begin before the first one still kept."""

    def __init__(self, starting_after: int, first_kept: int, max_bytes: int) -> None:
        super().__init__(f"the events after sequence_number {starting_after} are no longer kept: a background "
                         f"stream keeps its latest {max_bytes} bytes of events, from sequence_number {first_kept} "
                         f"now; reconnect with starting_after >= {first_kept - 1}, or GET the Response without stream")
        self.first_kept = first_kept


class EventLog:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._events: deque[tuple[int, bytes]] = deque()  # (sequence_number, the event as sent), oldest first
        self.num_bytes = 0
        self.first_kept = 0  # the sequence number of the oldest kept event (next_sequence when none is)
        self.next_sequence = 0
        self.done = False  # the Response ended: no event follows
        self._appended = asyncio.Event()  # set, and replaced, on each append and at the end

    def extend(self, events: Iterable[tuple[int, bytes]]) -> None:
        """Appends events in sequence (each numbered the next one); drops the oldest past the bound."""
        for sequence, data in events:
            if self.done:
                raise ValueError("the log has ended")
            if sequence != self.next_sequence:
                raise ValueError(f"event {sequence} out of sequence: expected {self.next_sequence}")
            self._events.append((sequence, data))
            self.num_bytes += len(data)
            self.next_sequence += 1
            while self.num_bytes > self.max_bytes:
                _, dropped = self._events.popleft()
                self.num_bytes -= len(dropped)
            self.first_kept = self._events[0][0] if self._events else self.next_sequence
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def check(self, starting_after: int) -> None:
        """Raises EventsGone when the events after `starting_after` are not all kept."""
        if starting_after + 1 < self.first_kept:
            raise EventsGone(starting_after, self.first_kept, self.max_bytes)

    def after(self, starting_after: int) -> list[tuple[int, bytes]]:
        """The kept events numbered above `starting_after` (EventsGone when some of them were dropped)."""
        self.check(starting_after)
        return list(islice(self._events, max(0, starting_after + 1 - self.first_kept), None))

    async def follow(self, starting_after: int) -> AsyncIterator[tuple[int, bytes]]:
        """Every event after `starting_after`, as they come, until the Response ends. A follower that
        falls behind by more than the bound gets EventsGone where the hole would have been."""
        position = starting_after
        while True:
            waited = self._appended
            for sequence, data in self.after(position):
                position = sequence
                yield sequence, data
            if self.done and position >= self.next_sequence - 1:
                return
            if position >= self.next_sequence - 1:
                await waited.wait()

    def _wake(self) -> None:
        self._appended.set()
        self._appended = asyncio.Event()
