"""Generate requests for one model version: continuous batching over its workers.

Each worker has its own KV blocks, so each runs its own step loop; waiting
sequences are admitted by whichever worker has room. There is no prefill or
decode phase: every step a running sequence computes the tokens it has not yet
computed (a prompt chunk, a recompute after preemption, or its last sampled
token), under the step's token budget.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common import errors
from services.scheduler.config import SchedulerConfig
from services.scheduler.worker_link import ModelKey, WorkerGone, WorkerLink

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    """New tokens for a stream; `finish_reason` set on the last one."""

    token_ids: list[int]
    text: str
    index: int
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    error: errors.InfermeshError | None = None


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    sampling: common_pb2.SamplingParams
    max_tokens: int
    eos_token_id: int
    arrival_s: float
    deadline_s: float | None
    trace_context: dict[str, str]
    seq_id: int = field(default_factory=WorkerLink.next_id)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    new_blocks: list[int] = field(default_factory=list)
    reset_blocks: bool = True
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False
    first_token_s: float | None = None
    admitted_s: float | None = None
    compute_s: float = 0.0
    num_streamed: int = 0
    _decoder: object = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    _text: str = ""

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class _WorkerLoop:
    """The step loop of one generator worker: its running set and its free KV blocks."""

    def __init__(self, pool: GeneratePool, link: WorkerLink) -> None:
        self.pool = pool
        self.link = link
        capacity = link.hello.capacity
        self.block_size = capacity.block_size or 16
        self.free_blocks: deque[int] = deque(range(capacity.num_kv_blocks))
        self.num_blocks = capacity.num_kv_blocks
        config = pool.config
        self.max_num_seqs = min(filter(None, (capacity.max_num_seqs, config.max_num_seqs))) if (
            capacity.max_num_seqs or config.max_num_seqs) else 32
        self.token_budget = min(filter(None, (capacity.max_num_batched_tokens, config.max_num_batched_tokens))) if (
            capacity.max_num_batched_tokens or config.max_num_batched_tokens) else 512
        self.running: list[Sequence] = []
        self.forget: list[int] = []

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    async def run(self) -> None:
        while not self.link.closed.is_set():
            self.pool.drop_finished(self)
            self.admit()
            if not self.running:
                if self.link.draining:
                    self.link.end_stream()
                    return
                await self.pool.wait_for_work(self.link)
                continue
            step, planned = self.plan()
            try:
                result = await self.link.run_step(step)
            except WorkerGone:
                self.pool.requeue(self.running)
                self.running = []
                return
            self.pool.apply(self, planned, result)

    def admit(self) -> None:
        if self.link.draining:
            return
        while len(self.running) < self.max_num_seqs:
            seq = self.pool.next_waiting(self)
            if seq is None:
                return
            self.running.append(seq)
            seq.admitted_s = seq.admitted_s or self.pool.clock()
            seq.reset_blocks = True
            seq.num_computed = 0
            seq.blocks = []

    def plan(self) -> tuple[scheduler_pb2.RunStep, list[tuple[Sequence, int]]]:
        budget = self.token_budget
        chunk_cap = self.pool.config.long_prefill_chunk_tokens or budget
        planned: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted while planning an earlier one
                continue
            todo = len(seq.all_ids) - seq.num_computed
            num_tokens = min(todo, budget, chunk_cap if todo > 1 else todo)
            if num_tokens <= 0:
                continue
            if not self.grow(seq, seq.num_computed + num_tokens):
                continue
            planned.append((seq, num_tokens))
            budget -= num_tokens
        step = scheduler_pb2.RunStep(step_id=WorkerLink.next_id(), finished_seq_ids=self.forget)
        self.forget = []
        for seq, num_tokens in planned:
            start = seq.num_computed
            step.seqs.append(
                scheduler_pb2.SequenceStep(
                    seq_id=seq.seq_id,
                    token_ids=seq.all_ids[start : start + num_tokens],
                    start_position=start,
                    new_blocks=seq.new_blocks,
                    reset_block_table=seq.reset_blocks,
                    sample=start + num_tokens == len(seq.all_ids),
                    sampling=seq.sampling,
                    num_generated=len(seq.output_ids),
                    trace_context=seq.trace_context,
                )
            )
            seq.new_blocks = []
            seq.reset_blocks = False
        return step, planned

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give seq blocks for num_tokens, preempting the newest other sequence when out of blocks."""
        while len(seq.blocks) < self.blocks_needed(num_tokens):
            if not self.free_blocks:
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    return False
                continue
            block = self.free_blocks.popleft()
            seq.blocks.append(block)
            seq.new_blocks.append(block)
        return True

    def preempt(self, seq: Sequence) -> None:
        log.info("preempting sequence %d of %s (recomputed later)", seq.seq_id, self.pool.model)
        self.release(seq)
        self.pool.requeue([seq])

    def release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.free_blocks.extend(seq.blocks)
        seq.blocks, seq.new_blocks = [], []
        seq.num_computed = 0
        self.forget.append(seq.seq_id)


class GeneratePool:
    def __init__(self, model: ModelKey, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.config = config
        self.clock = clock
        self._waiting: deque[Sequence] = deque()
        self._loops: dict[str, _WorkerLoop] = {}
        self._work = asyncio.Event()

    # -- workers -------------------------------------------------------------

    def add_worker(self, link: WorkerLink) -> None:
        loop = _WorkerLoop(self, link)
        self._loops[link.worker_id] = loop
        asyncio.create_task(loop.run())
        self._work.set()

    def remove_worker(self, link: WorkerLink) -> None:
        loop = self._loops.pop(link.worker_id, None)
        if loop is not None and loop.running:
            self.requeue(loop.running)
            loop.running = []
        self._work.set()

    @property
    def workers(self) -> list[WorkerLink]:
        return [loop.link for loop in self._loops.values()]

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def kv_usage(self) -> float:
        total = sum(loop.num_blocks for loop in self._loops.values())
        used = sum(loop.num_blocks - len(loop.free_blocks) for loop in self._loops.values())
        return used / total if total else 0.0

    # -- sequences -----------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        if not any(loop.link.usable for loop in self._loops.values()):
            raise errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0)
        if len(self._waiting) >= self.config.max_queue_size:
            raise errors.ResourceExhausted(
                f"queue for model {self.model} is full ({self.config.max_queue_size} sequences)", retry_after_s=0.5
            )
        max_seq_len = min(loop.link.hello.capacity.max_seq_len or 1 << 30 for loop in self._loops.values())
        if len(seq.prompt_ids) + seq.max_tokens > max_seq_len:
            raise errors.InvalidArgument(
                f"prompt of {len(seq.prompt_ids)} tokens plus max_tokens {seq.max_tokens} exceeds the "
                f"model's max sequence length {max_seq_len}"
            )
        self._waiting.append(seq)
        self._work.set()

    def abort(self, seq: Sequence) -> None:
        """Client cancel or deadline: frees its blocks before the next step."""
        seq.finished = True
        if seq in self._waiting:
            self._waiting.remove(seq)

    def requeue(self, seqs: list[Sequence]) -> None:
        for seq in reversed(seqs):
            if not seq.finished:
                seq.num_computed = 0
                seq.blocks, seq.new_blocks = [], []
                seq.reset_blocks = True
                self._waiting.appendleft(seq)
        self._work.set()

    def next_waiting(self, loop: _WorkerLoop) -> Sequence | None:
        self._drop_expired()
        if not self._waiting:
            return None
        seq = self._waiting[0]
        # Admit only when the whole prompt (plus the first token) fits in the free blocks.
        if loop.blocks_needed(len(seq.all_ids) + 1) > len(loop.free_blocks):
            return None
        return self._waiting.popleft()

    async def wait_for_work(self, link: WorkerLink) -> None:
        self._work.clear()
        closed = asyncio.create_task(link.closed.wait())
        work = asyncio.create_task(self._work.wait())
        await asyncio.wait({closed, work}, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        work.cancel()

    def drop_finished(self, loop: _WorkerLoop) -> None:
        now = self.clock()
        for seq in list(loop.running):
            if seq.deadline_s is not None and seq.deadline_s <= now and not seq.finished:
                seq.finished = True
                seq.events.put_nowait(TokenEvent([], "", seq.num_streamed, error=errors.DeadlineExceeded(
                    f"deadline passed after {len(seq.output_ids)} tokens")))
            if seq.finished:
                loop.release(seq)

    def _drop_expired(self) -> None:
        now = self.clock()
        for seq in [s for s in self._waiting if s.deadline_s is not None and s.deadline_s <= now]:
            self._waiting.remove(seq)
            seq.finished = True
            seq.events.put_nowait(TokenEvent([], "", seq.num_streamed, error=errors.DeadlineExceeded(
                "deadline passed while waiting for admission")))

    def apply(self, loop: _WorkerLoop, planned: list[tuple[Sequence, int]], result: scheduler_pb2.StepResult) -> None:
        outputs = {out.seq_id: out for out in result.outputs}
        step_compute_s = sum(s.duration_us for s in result.timings.stages) / 1e6
        now = self.clock()
        for seq, num_tokens in planned:
            if seq.finished or seq not in loop.running:
                continue
            seq.num_computed += num_tokens
            seq.compute_s += step_compute_s
            out = outputs.get(seq.seq_id)
            if out is None:
                continue
            if out.HasField("error") and out.error.code != 0:
                seq.finished = True
                seq.events.put_nowait(TokenEvent([], "", seq.num_streamed, error=errors.Internal(out.error.message)))
                loop.release(seq)
                continue
            self._append_token(seq, out.token_id, now)
            if seq.finished:
                loop.release(seq)

    def _append_token(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.first_token_s = seq.first_token_s or now
        seq.output_ids.append(token_id)
        finish = common_pb2.FINISH_REASON_UNSPECIFIED
        text = ""
        if token_id == seq.eos_token_id and not seq.sampling.ignore_eos:
            finish = common_pb2.FINISH_REASON_EOS
        else:
            text = seq._decoder.decode(bytes([token_id]) if token_id < 256 else b"")
            seq._text += text
            for stop in seq.sampling.stop:
                if stop and stop in seq._text:
                    finish = common_pb2.FINISH_REASON_STOP
                    break
        if finish == common_pb2.FINISH_REASON_UNSPECIFIED and len(seq.output_ids) >= seq.max_tokens:
            finish = common_pb2.FINISH_REASON_LENGTH
        if finish != common_pb2.FINISH_REASON_UNSPECIFIED:
            seq.finished = True
            text += seq._decoder.decode(b"", final=True)
        ids = [] if finish == common_pb2.FINISH_REASON_EOS else [token_id]
        seq.events.put_nowait(TokenEvent(ids, text, seq.num_streamed, finish))
        seq.num_streamed += len(ids)
