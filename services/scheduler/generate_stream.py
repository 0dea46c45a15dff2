"""The client's side of generate sequences: one `GenerateStream` each, and the open ones of a model version.

`ClientStreams` hands each step's chunks to their streams and ends a stream when its sequence
finishes, fails or expires. It also keeps the token-time metrics that only the client's side sees
(queue time, TTFT, inter-token gaps, time per output token). Which worker runs a sequence is the
pool's business: the table tells it, through `on_ended`, which streams ended here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from services.common import errors
from services.common.clock import Clock
from services.scheduler import metrics
from services.scheduler.attach_types import ModelKey
from services.scheduler.fair_queue import TenantContext
from services.scheduler.sequence import Sequence
from services.scheduler.step_plan import SequenceDelta, StepPlan

# Why a sequence failed when the worker named no reason.
_NO_VALID_TOKEN = "the worker returned no valid token"


# Not frozen: one is built per token (why: step_plan.SequenceStep).
@dataclass(slots=True)
class StreamEvent:
    """One chunk for the client, or the error that ends its stream."""

    delta: SequenceDelta | None = None
    error: errors.InfermeshError | None = None


class EventSink(Protocol):
    """Where a stream's events go: an asyncio.Queue, or a Submit stream's chunk builder."""

    def put_nowait(self, event: StreamEvent, /) -> None: ...


@dataclass(eq=False)
class GenerateStream:
    """The client's side of one sequence, and what the servicer reports in its last chunk."""

    seq_id: int
    tenant: TenantContext
    # Sampled with at every step, drawn at admission when the request named none: sampling repeats
    # exactly after preemption and failover.
    seed: int
    trace_context: Mapping[str, str]
    arrival_s: float
    deadline_s: float | None
    events: EventSink = field(default_factory=lambda: asyncio.Queue[StreamEvent]())
    seq: Sequence | None = None
    finished: bool = False
    first_scheduled_s: float | None = None
    # Worker compute time of the steps this sequence was part of.
    compute_s: float = 0.0
    last_chunk_s: float | None = None
    first_chunk_s: float | None = None
    num_tokens_seen: int = 0
    # A continuation (a stream resumed here): its first token is not the client's first token.
    resumed: bool = False


def deadline_error(stream: GenerateStream) -> errors.DeadlineExceeded:
    seq = stream.seq
    if seq is None or seq.first_scheduled_s is None:
        return errors.DeadlineExceeded("deadline passed while waiting for admission")
    return errors.DeadlineExceeded(f"deadline passed after {seq.num_generated} tokens")


class ClientStreams:
    """The unfinished streams of one model version by seq_id, and their token-time metrics."""

    def __init__(self, model: ModelKey, clock: Clock, on_ended: Callable[[int], object]) -> None:
        """`on_ended`: called with the seq_id of each stream that ends here (last chunk, failure,
        expiry), not of one the caller closes (close())."""
        self._streams: dict[int, GenerateStream] = {}
        self._clock = clock
        self._on_ended = on_ended
        # Labelled children looked up once: updated every step. By version too where a canary's token
        # latency is compared with its baseline's (docs/operations.md).
        self._ttft = metrics.TTFT.labels(model.name, model.version)
        self._queue_time = {p: metrics.QUEUE_TIME.labels(model.name, label) for p, label in metrics.PRIORITY_LABELS.items()}
        self._inter_token = metrics.INTER_TOKEN_LATENCY.labels(model.name)
        self._tpot = metrics.TIME_PER_OUTPUT_TOKEN.labels(model.name, model.version)

    @property
    def by_id(self) -> Mapping[int, GenerateStream]:
        return self._streams

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._streams

    def get(self, seq_id: int) -> GenerateStream | None:
        return self._streams.get(seq_id)

    def add(self, stream: GenerateStream) -> None:
        self._streams[stream.seq_id] = stream

    def close(self, seq_id: int) -> bool:
        """Forgets the stream; False if it had already finished."""
        stream = self._streams.pop(seq_id, None)
        if stream is None or stream.finished:
            return False
        stream.finished = True
        return True

    def fail(self, stream: GenerateStream, error: errors.InfermeshError) -> None:
        """Ends the stream with `error`, unless it had already finished."""
        if self.close(stream.seq_id):
            self._on_ended(stream.seq_id)
            stream.events.put_nowait(StreamEvent(error=error))

    # -- a step's life -------------------------------------------------------

    def planned(self, plan: StepPlan) -> None:
        """Ends the streams whose deadline passed; queue time of the sequences getting their first step."""
        now = self._clock()
        for seq_id in plan.expired_seq_ids:
            stream = self._streams.get(seq_id)
            if stream is not None:
                self.fail(stream, deadline_error(stream))
        if not plan.seqs:
            return
        for step in plan.seqs:
            if not step.reset_block_table:
                continue  # a sequence's first step always resets its block table: no lookup per decode
            stream = self._streams.get(step.seq_id)
            if stream is not None and stream.first_scheduled_s is None:
                stream.first_scheduled_s = now
                self._queue_time[stream.tenant.priority].observe(now - stream.arrival_s)

    def add_compute(self, plan: StepPlan, compute_s: float) -> None:
        """Adds a finished step's worker time to each of its streams."""
        streams = self._streams
        for step in plan.seqs:
            stream = streams.get(step.seq_id)
            if stream is not None:
                stream.compute_s += compute_s

    def deliver(self, deltas: list[SequenceDelta], failures: Mapping[int, errors.InfermeshError]) -> None:
        """Streams one step's chunks to their clients, ending a failed sequence's stream with the
        worker's reason from `failures`."""
        if not deltas:
            return
        now = self._clock()
        # Inter-token gaps of this step by value: the step's streams mostly share their last chunk's
        # time, so one histogram update per distinct gap instead of one per token.
        gaps: dict[float, int] = {}
        for delta in deltas:
            self._deliver(delta, failures, now, gaps)
        for gap_s, count in gaps.items():
            metrics.observe_many(self._inter_token, gap_s, count)

    def _deliver(self, delta: SequenceDelta, failures: Mapping[int, errors.InfermeshError], now: float,
                 gaps: dict[float, int]) -> None:
        stream = self._streams.get(delta.seq_id)
        if stream is None:
            return
        if delta.abort_reason is not None:
            self.fail(stream, _client_error(delta.seq_id, failures.get(delta.seq_id)))
            return
        self._observe_token_times(stream, delta, now, gaps)
        stream.events.put_nowait(StreamEvent(delta=delta))
        if delta.is_last:
            self.close(delta.seq_id)
            self._on_ended(delta.seq_id)

    def _observe_token_times(self, stream: GenerateStream, delta: SequenceDelta, now: float,
                             gaps: dict[float, int]) -> None:
        """TTFT and time per output token now; inter-token gaps added to `gaps` for deliver()."""
        num_tokens = len(delta.token_ids)
        if num_tokens:
            if stream.last_chunk_s is None:
                first_token_s = stream.seq.first_token_s if stream.seq and stream.seq.first_token_s else now
                if not stream.resumed:
                    self._ttft.observe(first_token_s - stream.arrival_s)
                stream.first_chunk_s = now
                num_tokens -= 1
            else:
                gap_s = (now - stream.last_chunk_s) / num_tokens
                gaps[gap_s] = gaps.get(gap_s, 0) + num_tokens
            stream.last_chunk_s = now
            stream.num_tokens_seen += len(delta.token_ids)
        first_s, last_s = stream.first_chunk_s, stream.last_chunk_s
        if delta.is_last and stream.num_tokens_seen > 1 and first_s is not None and last_s is not None:
            self._tpot.observe((last_s - first_s) / (stream.num_tokens_seen - 1))


def _client_error(seq_id: int, failure: errors.InfermeshError | None) -> errors.InfermeshError:
    """What the client of a sequence the worker failed is told. An INVALID_ARGUMENT naming a request
    field (`sampling.`: a grammar that forces an endless sequence, found only while sampling) is the
    caller's and passes as it is; any other failure (a block table the worker refused is
    INVALID_ARGUMENT too) is ours: Internal."""
    if isinstance(failure, errors.InvalidArgument) and failure.message.startswith("sampling."):
        return failure
    reason = failure.message if failure is not None else _NO_VALID_TOKEN
    return errors.Internal(f"worker failed sequence {seq_id}: {reason}")
