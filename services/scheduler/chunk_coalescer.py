"""Stream coalescing: one sequence's consecutive deltas merged into fewer, larger chunks.

A client that set GenerateRequest.stream gets a chunk when it holds
max_tokens_per_chunk tokens, or when interval_ms passed since its previous chunk
was sent, or when the stream ends. The first token is never held (time to first
token must not pay the interval), nor is the last chunk (finish_reason, usage).

Merging only concatenates: a merged chunk's token ids are its deltas' ids in
order, its text their texts joined (each delta's text already continues the
bytes held back before it, so the join is valid UTF-8 exactly as the
uncoalesced stream's), its index the first delta's index. So the concatenation
of all chunks is identical with and without coalescing; only the grouping differs.

`ChunkCoalescer` is the decision (pure, injected clock). `CoalescedEvents` puts
it between the pool and a stream's consumer, with a timer so held tokens go out
when their interval ends even if the sequence makes no further step (preempted,
waiting for a worker).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

from services.common.stream_options import StreamOptions
from services.scheduler.generate_stream import StreamEvent
from services.scheduler.step_plan import SequenceDelta


class ChunkCoalescer:
    """Which of one sequence's deltas to send now, merged; the rest held until `due_s`."""

    __slots__ = ("_max_tokens", "_interval_s", "_clock", "_pending", "_num_pending_tokens", "_last_sent_s")

    def __init__(self, options: StreamOptions, clock: Callable[[], float]) -> None:
        self._max_tokens = options.max_tokens_per_chunk
        self._interval_s = options.interval_ms / 1000
        self._clock = clock
        self._pending: list[SequenceDelta] = []
        self._num_pending_tokens = 0
        # None until the first chunk went: the first token is never held.
        self._last_sent_s: float | None = None

    @property
    def num_pending_tokens(self) -> int:
        return self._num_pending_tokens

    @property
    def due_s(self) -> float | None:
        """When the held deltas must go by the interval; None when nothing is held or there is no timer."""
        if not self._pending or not self._interval_s or self._last_sent_s is None:
            return None
        return self._last_sent_s + self._interval_s

    def push(self, delta: SequenceDelta) -> list[SequenceDelta]:
        """The chunks to send now, in order (none, one, or two when delta would overfill the held chunk)."""
        out: list[SequenceDelta] = []
        num_tokens = len(delta.token_ids)
        if self._max_tokens and self._num_pending_tokens and self._num_pending_tokens + num_tokens > self._max_tokens:
            # Send what is held first, so a chunk never exceeds the limit by merging (one step's
            # tokens for one sequence are never split: their text cannot be cut between tokens).
            out.append(self._take())
        self._pending.append(delta)
        self._num_pending_tokens += num_tokens
        if self._should_send(delta):
            out.append(self._take())
        return out

    def take_due(self) -> SequenceDelta | None:
        """For the timer: the held chunk if its interval has passed, else None (not yet, or nothing held)."""
        due_s = self.due_s
        if due_s is None or self._clock() < due_s:
            return None
        return self._take()

    def take_all(self) -> SequenceDelta | None:
        """Whatever is held, regardless of the rule (the stream ends with an error after it)."""
        return self._take() if self._pending else None

    def _should_send(self, delta: SequenceDelta) -> bool:
        if delta.is_last:
            return True
        if self._num_pending_tokens == 0:
            return False  # text without tokens (held-back bytes released) rides with the next token
        if self._last_sent_s is None:
            return True
        if self._max_tokens and self._num_pending_tokens >= self._max_tokens:
            return True
        return bool(self._interval_s) and self._clock() - self._last_sent_s >= self._interval_s

    def _take(self) -> SequenceDelta:
        pending, self._pending = self._pending, []
        self._num_pending_tokens = 0
        self._last_sent_s = self._clock()
        if len(pending) == 1:
            return pending[0]
        token_ids: list[int] = []
        logprobs: list = []
        for delta in pending:
            token_ids.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)
        # The last delta carries what describes the stream so far (finish_reason, usage counts); the
        # stream's first, the prompt's logprobs.
        first = next((delta for delta in pending if delta.prompt_token_ids), pending[-1])
        return dataclasses.replace(pending[-1], token_ids=tuple(token_ids), logprobs=tuple(logprobs),
                                   text="".join(delta.text for delta in pending), index=pending[0].index,
                                   prompt_token_ids=first.prompt_token_ids, prompt_logprobs=first.prompt_logprobs)


class Events(Protocol):
    """Where a stream's events go: an asyncio.Queue (unary Generate) or a Submit stream's chunk sink."""

    def put_nowait(self, event: StreamEvent) -> None: ...


class TimerHandle(Protocol):
    def cancel(self) -> None: ...


class CoalescedEvents:
    """Stands in for GenerateStream.events: the pool puts every delta here, `downstream` gets merged chunks.

    call_later(delay_s, callback) arms the interval timer (the event loop's call_later in service).
    """

    __slots__ = ("_downstream", "_coalescer", "_call_later", "_clock", "_timer", "_timer_due_s")

    def __init__(self, downstream: Events, coalescer: ChunkCoalescer, clock: Callable[[], float],
                 call_later: Callable[[float, Callable[[], None]], TimerHandle]) -> None:
        self._downstream = downstream
        self._coalescer = coalescer
        self._clock = clock
        self._call_later = call_later
        self._timer: TimerHandle | None = None
        self._timer_due_s: float | None = None

    def put_nowait(self, event: StreamEvent) -> None:
        if event.error is not None:
            # Tokens already made reach the client before the error, as they would uncoalesced
            # (a gateway resuming the stream elsewhere continues after the tokens it saw).
            held = self._coalescer.take_all()
            if held is not None:
                self._downstream.put_nowait(StreamEvent(delta=held))
            self.close()
            self._downstream.put_nowait(event)
            return
        assert event.delta is not None  # an event is an error or a delta
        for chunk in self._coalescer.push(event.delta):
            self._downstream.put_nowait(StreamEvent(delta=chunk))
        self._arm()

    def close(self) -> None:
        """The stream ended (or its caller went away): no timer may fire for it any more."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_due_s = None

    def _arm(self) -> None:
        due_s = self._coalescer.due_s
        if due_s == self._timer_due_s:
            return
        self.close()
        if due_s is not None:
            self._timer_due_s = due_s
            self._timer = self._call_later(max(0.0, due_s - self._clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_due_s = None
        chunk = self._coalescer.take_due()
        if chunk is not None:
            self._downstream.put_nowait(StreamEvent(delta=chunk))
        self._arm()  # re-arms when the timer fired a little early (loop clock resolution)
