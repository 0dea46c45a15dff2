"""One admitted Generate call at the scheduler, for both transports: its sequence's stream in the
pool, and the chunks it fills (the first names the model, the last carries usage and timings)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from typing import Any

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.clock import Clock
from services.common.logprobs import PositionLogprobs
from services.common.timings import StageTime, seconds_to_us, to_proto
from services.scheduler.call_codec import FINISH_REASONS
from services.scheduler.chunk_coalescer import CoalescedEvents
from services.scheduler.embed_request import shaped
from services.scheduler.generate_stream import GenerateStream, StreamEvent
from services.scheduler.model_registry import GeneratorEntry
from services.scheduler.model_text import NO_REASONING, ReasoningStart
from services.scheduler.step_plan import SequenceDelta

SERVICE = "scheduler"


class GenerateCall:
    __slots__ = ("_request_id", "_entry", "stream", "_began_s", "_span", "_model", "_first", "_clock",
                 "_finished", "_tool_call_parser", "_prompt_token_ids", "_reasoning", "_embedding")

    def __init__(self, request_id: str, entry: GeneratorEntry, stream: GenerateStream, began_s: float,
                 span: Any, clock: Clock, finished: Callable[[str, float], None], tool_call_parser: str = "",
                 prompt_token_ids: Sequence[int] = (), reasoning: ReasoningStart = NO_REASONING,
                 embedding: tuple[int | None, bool] | None = None) -> None:
        """`finished(model_name, latency_s)`: called as the last chunk is built. `tool_call_parser`:
        named on the first chunk (a request offering tools), as are `prompt_token_ids` (return_token_ids)
        and `reasoning` (the model's reasoning parser, what the prompt left open, and whether the
        request's grammar waits for the reasoning to end). `embedding`: an embed request's (dimensions asked,
        None: all; whether the model normalizes), which shape its vector (embed_request.shaped)."""
        self._embedding = embedding
        self._reasoning = reasoning
        self._prompt_token_ids = prompt_token_ids
        self._request_id = request_id
        self._entry = entry
        self.stream = stream
        self._began_s = began_s
        self._span = span
        self._model = common_pb2.ModelRef(name=entry.key.name, version=entry.key.version)
        self._first = True
        self._clock = clock
        self._finished = finished
        self._tool_call_parser = tool_call_parser

    def fill_chunk(self, chunk: gateway_pb2.GenerateResponse, delta: SequenceDelta) -> None:
        """Builds delta's chunk in place."""
        chunk.request_id = self._request_id
        chunk.token_ids.extend(delta.token_ids)
        chunk.text = delta.text
        chunk.index = delta.index
        if delta.logprobs:
            self._fill_logprobs(chunk, delta)
        if delta.prompt_token_ids:
            self._fill_prompt_logprobs(chunk, delta)
        if delta.finish_reason is not None:
            chunk.finish_reason = FINISH_REASONS[delta.finish_reason]
        if self._first:
            chunk.model.CopyFrom(self._model)
            chunk.tool_call_parser = self._tool_call_parser
            chunk.reasoning_parser = self._reasoning.parser
            chunk.reasoning_opened = self._reasoning.opened
            chunk.grammar_after_reasoning = self._reasoning.grammar_after is not None
            if self._prompt_token_ids:
                chunk.prompt_token_ids.extend(self._prompt_token_ids)
            self._first = False
        if delta.end_token_id is not None:
            chunk.end_token_id = delta.end_token_id
        if delta.embedding and self._embedding is not None:
            chunk.embedding.extend(shaped(delta.embedding, *self._embedding))
        if delta.is_last:
            self._fill_last(chunk, delta)
            self._span.set_attribute("infermesh.completion_tokens", delta.num_generated)

    def _fill_logprobs(self, chunk: gateway_pb2.GenerateResponse, delta: SequenceDelta) -> None:
        """One PositionLogprobs per token."""
        self._fill_positions(chunk.logprobs, delta.token_ids, delta.logprobs)

    def _fill_prompt_logprobs(self, chunk: gateway_pb2.GenerateResponse, delta: SequenceDelta) -> None:
        """One PositionLogprobs per prompt token: NaN for the first (nothing predicts it)."""
        self._fill_positions(chunk.prompt_logprobs, delta.prompt_token_ids, delta.prompt_logprobs)

    def _fill_positions(self, positions: RepeatedCompositeFieldContainer[common_pb2.PositionLogprobs],
                        token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs | None]) -> None:
        """Adds one PositionLogprobs per (token, logprobs) pair, each token's bytes added (the gateway
        has no tokenizer)."""
        token_bytes = self._entry.pool.tokenizer.token_bytes
        add = positions.add
        for token_id, position_logprobs in zip(token_ids, logprobs, strict=True):
            position = add()
            position.token.token_id = token_id
            position.token.token_bytes = token_bytes(token_id)
            # The worker sent none (one predating logprobs; the prompt's first token): NaN, never a made-up value.
            if position_logprobs is None:
                position.token.logprob = math.nan
                continue
            position.token.logprob = position_logprobs.token.logprob
            add_top = position.top.add
            for top in position_logprobs.top:
                add_top(token_id=top.token_id, logprob=top.logprob, token_bytes=token_bytes(top.token_id))

    def _fill_last(self, chunk: gateway_pb2.GenerateResponse, delta: SequenceDelta) -> None:
        stream, began_s = self.stream, self._began_s
        now_s = self._clock()
        chunk.model.CopyFrom(self._model)
        chunk.usage.prompt_tokens = delta.num_prompt_tokens
        chunk.usage.completion_tokens = delta.num_generated
        if stream.seq is not None:
            chunk.usage.cached_prompt_tokens = stream.seq.num_cached_prompt_tokens
            chunk.stop_string = stream.seq.stream.matched_stop
        first_token_s = stream.seq.first_token_s if stream.seq is not None and stream.seq.first_token_s else now_s
        chunk.ttft_us = seconds_to_us(first_token_s - began_s)
        scheduled_s = stream.first_scheduled_s or began_s
        queue_us = seconds_to_us(scheduled_s - began_s)
        compute_us = seconds_to_us(stream.compute_s)
        total_us = seconds_to_us(now_s - began_s)
        stages = [
            StageTime("queue_wait", queue_us, SERVICE),
            StageTime("compute", compute_us, "worker"),
            # Steps' network, scheduling and waits for the rest of each step's batch.
            StageTime("overhead", max(0, total_us - queue_us - compute_us), SERVICE),
            StageTime("scheduler", total_us, SERVICE),
        ]
        chunk.timings.CopyFrom(to_proto(stages, total_us=seconds_to_us(now_s - began_s)))
        self._finished(self._model.name, now_s - began_s)

    @property
    def model_name(self) -> str:
        return self._entry.key.name

    def hand_over(self, error: errors.Unavailable) -> bool:
        """The scheduler drains: end the stream with `error` for the caller to resume elsewhere."""
        handed_over = self._entry.pool.hand_over(self.stream, error)
        if handed_over:
            self._span.set_attribute("infermesh.handed_over", True)
        return handed_over

    def abort_unless_finished(self) -> None:
        """The caller went away (or the call failed): drop the sequence and free its KV blocks now."""
        if not self.stream.finished:
            self._entry.pool.abort(self.stream)
        if isinstance(self.stream.events, CoalescedEvents):
            self.stream.events.close()  # no interval timer may outlive the call


class ChunkSink:
    """Stands in for GenerateStream.events on a Submit stream: the pool's `put_nowait(event)` builds
    the chunk at once in the stream's outbox, so a step's chunks cost no await or task per token."""

    __slots__ = ("_next_chunk", "call", "done")

    def __init__(self, next_chunk: Callable[[], gateway_pb2.GenerateResponse]) -> None:
        self._next_chunk = next_chunk
        self.call: GenerateCall | None = None
        # Resolves with the last chunk, or fails with the error that ends the sequence.
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def put_nowait(self, event: StreamEvent, /) -> None:
        if self.done.done():
            return
        if event.error is not None:
            self.done.set_exception(event.error)
            return
        assert self.call is not None and event.delta is not None  # set at admission; an event is one or the other
        self.call.fill_chunk(self._next_chunk(), event.delta)
        if event.delta.is_last:
            self.done.set_result(None)
