"""Generate requests for one model version: one StepScheduler per worker, wired to its Attach stream.

Each worker has its own KV blocks, so each gets its own `StepScheduler` (continuous
batching, chunked prefill, preemption by recompute) and its own step loop:
schedule() -> RunStep over the stream -> update_from_output() -> chunks to the
clients' streams. With `--pipelined-steps on` and a worker that declares
max_steps_in_flight >= 2, the loop keeps two steps in flight when it can: as soon as step N
is sent, step N+1 is planned (StepScheduler.schedule_ahead) and sent, its decodes taking N's
samples on the worker, so the worker does not wait a round trip between decode steps. While no
sequence waits for a slot, and the worker declares max_steps_per_command, the steps planned ahead
go `--steps-per-command` (K) at a time in one RunSteps command, answered with one message: the
first step after an idle spell goes alone (its first token comes back after one step), then K
more, and the next K when the worker has about one step and _COMMAND_LEAD_S left of those in
flight. A lone stream on tinylm (CPU) spent 1.43 ms a token one step per command (1.2 ms of model
step: the messages between steps evict its caches, back to back it takes 1.0 ms) and 1.24 ms at
K=4 (2026-11-27, before the model step got cheaper); tokens reach the client K at a time. A sequence arriving meanwhile gets its first step planned
at once, right behind the steps in flight (about K+2 at most). A new
sequence goes where `--routing` says (prefix_routing.py: by default the worker that computes
least before its first token, its cached prefix counted).

Failover: when a worker's stream breaks, its scheduler's sequences are evicted
with what they generated so far and adopted by the other workers, which recompute
prompt + generated tokens; the client's stream continues at the next index, with
nothing repeated or skipped. With no worker left they are held until one attaches,
at most until their deadline (or `orphan_grace_ms` without one). A draining
worker finishes its running sequences and hands its waiting ones to the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from services.common import errors
from services.common.clock import Clock
from services.common.log_context import clean_context
from services.scheduler import metrics
from services.scheduler.attach_types import (
    StepCommand,
    StepOutcome,
    StepsCommand,
    WorkerCapacity,
    WorkerHello,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.model_text import build_model_text
from services.scheduler.prefix_cache import PrefixCacheKeys
from services.scheduler.prefix_routing import Route, Router, RoutingMode, WorkerLoad, WorkerView
from services.scheduler.pressure import ModelPressure, generator_pressure
from services.scheduler.sequence import AbortReason, SamplingParams, Sequence
from services.scheduler.step_plan import SequenceDelta, StepPlan
from services.scheduler.step_scheduler import StepScheduler, StepSchedulerFactory
from services.scheduler.step_scheduler_config import step_scheduler_config
from services.scheduler.tenant_service import TenantService
from services.scheduler.worker_link import ModelKey, WorkerGone, WorkerLink

log = logging.getLogger(__name__)

# A scheduler with work but nothing it may run now (rare: admission blocked) looks again this often.
_BLOCKED_POLL_S = 0.01
# A command of several steps leaves when the worker has one step and this long left of the steps in
# flight (planning it and its trip take less), so the worker never waits for it and a newcomer finds
# no more than that ahead of its first step.
_COMMAND_LEAD_S = 0.001


@dataclass(frozen=True)
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


@dataclass
class _SentStep:
    plan: StepPlan
    result: asyncio.Future[StepOutcome]
    sent_at_s: float
    # Its place among the steps sent in one command, and their number: their results come back together.
    index_in_command: int = 0
    command_size: int = 1


def steps_per_command(config: SchedulerConfig, capacity: WorkerCapacity) -> int:
    """Most decode steps a pipelined worker loop sends in one command (1: one per command)."""
    return max(1, min(config.steps_per_command, capacity.max_steps_per_command, capacity.max_steps_in_flight // 2))


class _WorkerLoop:
    """The step loop of one generator worker: schedule -> send -> await -> update, with what no next
    step waits for (the last step's chunks and bookkeeping) done while the worker computes. Pipelined,
    the next step is planned and sent before the oldest one's result is awaited."""

    def __init__(self, pool: GeneratePool, link: WorkerLink, scheduler: StepScheduler) -> None:
        self.pool = pool
        self.link = link
        self.scheduler = scheduler
        self.attached = True
        self.pipelined = pool.config.pipelined_steps and link.hello.capacity.max_steps_in_flight >= 2
        self.steps_per_command = steps_per_command(pool.config, link.hello.capacity) if self.pipelined else 1
        self._in_flight: deque[_SentStep] = deque()
        self._command_step_s = 0.0  # per step, of the command whose results are being applied
        # Set when the next command of several steps is due (a timer), or a sequence arrives meanwhile.
        self._due: asyncio.Future[None] | None = None
        self._due_timer: asyncio.Task[None] | None = None
        # Looked up once: _update_gauges sets it for every worker after every step of every worker.
        self.kv_gauge = metrics.KV_CACHE_USAGE.labels(pool.model.name, link.worker_id)
        self.cache_metrics = metrics.PrefixCacheMetrics(pool.model.name, link.worker_id)
        self._wake = asyncio.Event()
        # The last step, its outcome and its chunks, until handed out by _flush().
        self._done: tuple[StepPlan, StepOutcome] | None = None
        self._deltas: list[SequenceDelta] = []
        self._result_at_s: float | None = None  # when the last step's result came back
        self.task = asyncio.create_task(self.run())

    def wake(self) -> None:
        self._wake.set()
        if self._due is not None and not self._due.done():
            self._due.set_result(None)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._disarm()

    async def _run(self) -> None:
        while self.attached:
            sent = []
            if not self._in_flight:
                if not self.scheduler.has_work():
                    self._flush()
                    self._result_at_s = None
                    self._command_step_s = 0.0  # the next command's steps may be another size
                    if self.link.draining:
                        self.link.end_stream()
                        return
                    await self._sleep(None)
                    continue
                # Critical path: from the last result to this send, only what the next step needs.
                plan = self.scheduler.schedule()
                if not self._send((plan,)):
                    self.pool.after_schedule(plan)
                    self._flush()
                    if not await self._after_unsent(plan):
                        return
                    continue
                sent.append(plan)
            if self.pipelined:
                sent.extend(self._send_ahead())
            if sent:
                await asyncio.sleep(0)  # the Attach writer puts the steps on the wire first
            # Then, while the worker computes: metrics, and the last step's chunks to the clients.
            for plan in sent:
                self.pool.after_schedule(plan)
            self._flush()
            oldest = self._in_flight[0]
            if self._command_pending() and not oldest.result.done():
                # A sequence arriving while steps are in flight gets its first step in right behind them.
                if self._wake.is_set():
                    self._wake.clear()
                    continue  # one arrived since the steps were planned
                due = self._arm(None)
                await asyncio.wait((oldest.result, due), return_when=asyncio.FIRST_COMPLETED)
                if not oldest.result.done():
                    continue  # the next command is due, or a sequence arrived: plan again
            try:
                outcome = await oldest.result
            except WorkerGone:
                return  # remove_worker() evicts every sequence, those of both steps in flight included
            if not self.attached:
                return
            self._in_flight.popleft()
            self._update(oldest, outcome)

    def _send_ahead(self) -> list[StepPlan]:
        """Steps planned ahead of those in flight, sent as one command, once no more than a command's
        worth is in flight: up to steps_per_command while no sequence waits for a slot, else one (a
        waiting sequence is admitted by the next step planned, so that comes soon)."""
        if self._due is not None and self._due.done():
            self._disarm()  # it brought us here
        if self.scheduler.num_waiting:
            # A newcomer's first step goes right behind a command of several steps; then one at a time.
            per_command = 1
            if len(self._in_flight) > 1 and self._in_flight[-1].command_size == 1:
                return []
        else:
            per_command = self.steps_per_command
            if len(self._in_flight) > per_command:
                return []
            if per_command > 1 and (wait_s := self._until_next_command_s()) > 0:
                self._arm(wait_s)
                return []
        self._disarm()
        plans: list[StepPlan] = []
        while len(plans) < per_command and (ahead := self.scheduler.schedule_ahead()) is not None:
            plans.append(ahead)
        if not plans or not self._send(tuple(plans)):
            return []
        self.pool.pipelined_steps.inc(len(plans))
        return plans

    def _command_pending(self) -> bool:
        """Whether the loop waits on arrivals and its timer as well as results: only while a command of
        several steps is in flight or the next one is timed (one step at a time, each result plans the
        next, and waiting on more would cost every step)."""
        return self._due_timer is not None or (bool(self._in_flight) and self._in_flight[-1].command_size > 1)

    def _until_next_command_s(self) -> float:
        """Seconds until the worker has one step and _COMMAND_LEAD_S left of the steps in flight, by the
        per-step time of the last command of several steps (none measured yet: now)."""
        step_s = self._command_step_s
        if self._result_at_s is None or not self._in_flight or step_s <= 0:
            return 0.0
        ends_s = self._result_at_s + len(self._in_flight) * step_s
        return ends_s - step_s - _COMMAND_LEAD_S - self.pool.clock()

    def _arm(self, wait_s: float | None) -> asyncio.Future[None]:
        """What makes the loop plan again: done in `wait_s` (None: when a sequence arrives)."""
        if self._due is None or self._due.done():
            self._due = asyncio.get_running_loop().create_future()
        if wait_s is not None and self._due_timer is None:
            self._due_timer = asyncio.create_task(self._fire_after(wait_s, self._due))
        return self._due

    async def _fire_after(self, wait_s: float, due: asyncio.Future[None]) -> None:
        await self.pool.sleep(wait_s)
        if not due.done():
            due.set_result(None)

    def _disarm(self) -> None:
        if self._due_timer is not None:
            self._due_timer.cancel()
        self._due = self._due_timer = None

    def _send(self, plans: tuple[StepPlan, ...]) -> bool:
        """Puts the steps on their way to the worker, in one command; False when the first has nothing to
        run or the worker is gone."""
        if not plans[0].has_work():
            return False
        try:
            if len(plans) == 1:
                results = [self.link.run_step(StepCommand(plans[0], self.pool.streams))]
            else:
                results = self.link.run_steps(StepsCommand(plans, self.pool.streams))
        except WorkerGone:
            return False
        now = self.pool.clock()
        for index, (plan, result) in enumerate(zip(plans, results, strict=True)):
            # A step behind the one whose failure ends the loop is never awaited: its WorkerGone is expected.
            result.add_done_callback(_retrieve)
            self._in_flight.append(_SentStep(plan, result, now, index, len(plans)))
        return True

    async def _after_unsent(self, plan: StepPlan) -> bool:
        """A step with nothing sent: the worker still forgets finished sequences. False: stop the loop."""
        if plan.finished_seq_ids:
            self.link.abort(plan.finished_seq_ids)
        if self.link.closed.is_set():
            return False  # remove_worker() evicts this worker's sequences to the others
        if self.scheduler.has_work():
            await self._sleep(_BLOCKED_POLL_S)
        return True

    def _update(self, step: _SentStep, outcome: StepOutcome) -> None:
        """Applies the worker's result (what the next step depends on); its chunks wait for _flush()."""
        now = self.pool.clock()
        # A step sent before the last result ran after it: its round trip starts there, with no gap.
        began_s, gap_s = step.sent_at_s, 0.0
        if self._result_at_s is not None:
            began_s = max(began_s, self._result_at_s)
            gap_s = max(0.0, step.sent_at_s - self._result_at_s)
        step_time_s = None
        if step.command_size > 1:
            # The command's results came back together: each step gets an even share of its time.
            if step.index_in_command == 0:
                self._command_step_s = (now - began_s) / step.command_size
            step_time_s = self._command_step_s
        self.pool.observe_step(now - began_s if step_time_s is None else step_time_s, outcome.worker_total_s, gap_s)
        self._result_at_s = now
        self._deltas = self.pool.after_step(self, step.plan, outcome, step_time_s)
        self._done = (step.plan, outcome)

    def _flush(self) -> None:
        """The last step's bookkeeping and chunks, once."""
        if self._done is not None:
            self.pool.account_step(*self._done)
            self._done = None
        self.pool.deliver(self._deltas)
        self._deltas = []

    async def _sleep(self, timeout_s: float | None) -> None:
        self._wake.clear()
        timer = None if timeout_s is None else asyncio.get_running_loop().call_later(timeout_s, self._wake.set)
        await self._wake.wait()
        if timer is not None:
            timer.cancel()


class GeneratePool:
    def __init__(self, model: ModelKey, hello: WorkerHello, config: SchedulerConfig,
                 clock: Clock = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 step_scheduler: StepSchedulerFactory = StepScheduler) -> None:
        """`sleep`: waits out `clock` seconds (a fake clock's in tests); `step_scheduler`: makes each
        worker's StepScheduler (a benchmark's baseline may bring its own)."""
        spec = hello.tokenizer
        self.model = model
        self.config = config
        self.clock = clock
        self.sleep = sleep
        self._make_step_scheduler = step_scheduler
        # Built by the Attach session (HF off the event loop); a hello made in-process (tests, benchmarks) has none.
        self.text = hello.text if hello.text is not None else build_model_text(spec)
        self.tokenizer = self.text.tokenizer
        self._loops: dict[str, _WorkerLoop] = {}
        # One set of tenant service counters for all of this model's workers (generate fairness).
        self._tenant_service = TenantService()
        self._streams: dict[int, GenerateStream] = {}
        self._where: dict[int, _WorkerLoop] = {}
        # Evicted sequences no worker could take, with when they started waiting.
        self._held: dict[int, tuple[Sequence, float]] = {}
        # Why the worker failed a sequence, until its error is delivered.
        self._failures: dict[int, str] = {}
        self._hold_timer: asyncio.Task[None] | None = None
        # Blocks named as each worker's StepScheduler names them (tenant salt, public prefixes).
        prefix_keys = PrefixCacheKeys.of(self.tokenizer.encode(text) for text in config.public_prefix_texts())
        self._router: Router[_WorkerLoop] = Router(RoutingMode(config.routing), clock,
                                                   prefix_keys.block_hashes if config.prefix_cache else None)
        # cache_aware: sequences routed with prompt tokens still to compute, by seq_id: where they went,
        # and the tokens routing counted as cached there (see _views).
        self._prefilling: dict[int, tuple[_WorkerLoop, Sequence, int]] = {}
        self._label = model.name
        # Labelled children looked up once: the step loop updates them every step.
        self._step_time = metrics.STEP_TIME.labels(model.name)
        self._step_overhead = metrics.STEP_OVERHEAD.labels(model.name)
        self._batch_size = metrics.BATCH_SIZE.labels(model.name)
        self._preemptions = metrics.PREEMPTIONS.labels(model.name)
        self.pipelined_steps = metrics.PIPELINED_STEPS.labels(model.name)
        # By version too: a canary's token latency against its baseline's (docs/operations.md).
        self._ttft = metrics.TTFT.labels(model.name, model.version)
        self._queue_time = {p: metrics.QUEUE_TIME.labels(model.name, label) for p, label in metrics.PRIORITY_LABELS.items()}
        self._inter_token = metrics.INTER_TOKEN_LATENCY.labels(model.name)
        self._tpot = metrics.TIME_PER_OUTPUT_TOKEN.labels(model.name, model.version)
        self._gauges = (
            metrics.RUNNING_SEQUENCES.labels(model.name),
            metrics.WAITING_SEQUENCES.labels(model.name),
            {p: metrics.QUEUE_DEPTH.labels(model.name, label) for p, label in metrics.PRIORITY_LABELS.items()},
        )

    # -- workers -------------------------------------------------------------

    def add_worker(self, link: WorkerLink) -> None:
        capacity = link.hello.capacity
        kv = KVBlockManager(capacity.num_kv_blocks, capacity.block_size or 16)
        scheduler = self._make_step_scheduler(step_scheduler_config(self.config, capacity), kv, self.tokenizer,
                                              self.clock, self._tenant_service)
        self._loops[link.link_id] = _WorkerLoop(self, link, scheduler)
        if self._held:
            held = [seq for seq, _ in self._held.values()]
            self._held.clear()
            log.info("worker %s adopts %d held sequences of %s", link.worker_id, len(held), self.model)
            self._place(held)
        self._update_gauges()

    def drain_worker(self, link: WorkerLink) -> None:
        """The worker finishes its running sequences; its waiting ones move to the others."""
        loop = self._loops.get(link.link_id)
        if loop is None:
            return
        if self._usable_loops():
            self._place(loop.scheduler.evict_waiting())
        loop.wake()

    def remove_worker(self, link: WorkerLink) -> None:
        loop = self._loops.pop(link.link_id, None)
        if loop is None:
            return
        loop.attached = False
        loop.wake()
        self._router.forget_worker(loop)
        if not any(other.link.worker_id == link.worker_id for other in self._loops.values()):
            try:  # no stale series for a worker that is gone (its prefix cache index goes with it)
                metrics.KV_CACHE_USAGE.remove(self.model.name, link.worker_id)
            except KeyError:
                pass
            loop.cache_metrics.remove()
        evicted = [seq for seq in loop.scheduler.evict_all() if seq.seq_id in self._streams]
        if evicted:
            log.warning("worker %s of %s gone: recomputing %d sequences elsewhere", link.worker_id, self.model,
                        len(evicted))
        self._place(evicted)
        self._update_gauges()

    def num_sequences_on(self, link: WorkerLink) -> int:
        """Unfinished sequences the worker holds or will run (0 for a worker not here)."""
        loop = self._loops.get(link.link_id)
        return 0 if loop is None else loop.scheduler.num_unfinished

    @property
    def streams(self) -> Mapping[int, GenerateStream]:
        """The unfinished sequences' streams by seq_id."""
        return self._streams

    @property
    def workers(self) -> list[WorkerLink]:
        return [loop.link for loop in self._loops.values()]

    @property
    def queue_depth(self) -> int:
        return sum(loop.scheduler.num_waiting for loop in self._loops.values()) + len(self._held)

    def max_seq_len(self) -> int:
        return min((loop.scheduler.config.max_seq_len for loop in self._loops.values()), default=1 << 30)

    def pressure(self) -> ModelPressure:
        pressure = generator_pressure([loop.scheduler for loop in self._loops.values()])
        # A draining worker serves nothing new (and workers choosing a scheduler must not count it).
        num_usable = len(self._usable_loops())
        if self._held or num_usable != pressure.num_workers:
            pressure = dataclasses.replace(pressure, queue_depth=pressure.queue_depth + len(self._held),
                                           num_workers=num_usable)
        return pressure

    def kv_usage(self) -> float:
        return self.pressure().kv_usage

    # -- sequences -----------------------------------------------------------

    def submit(self, stream: GenerateStream, prompt_ids: tuple[int, ...], sampling: SamplingParams,
               delivered_token_ids: tuple[int, ...] = ()) -> None:
        """`delivered_token_ids`: a continuation's tokens (StepScheduler.add_request)."""
        loops = self._usable_loops()
        if not loops:
            raise errors.Unavailable(f"no worker serves model {self.model}", retry_after_s=1.0)
        max_seq_len = self.max_seq_len()
        if len(prompt_ids) + sampling.max_tokens > max_seq_len:
            raise errors.InvalidArgument(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens {sampling.max_tokens} exceeds the "
                f"model's max sequence length {max_seq_len}"
            )
        route = self._router.choose(prompt_ids + delivered_token_ids, stream.tenant.tenant_id, self._views(loops))
        loop = route.worker
        stream.seq = loop.scheduler.add_request(
            stream.seq_id, prompt_ids, sampling, stream.tenant, deadline_s=stream.deadline_s,
            delivered_token_ids=delivered_token_ids, block_hashes=route.block_hashes,
        )
        self._note_prefilling(stream.seq, route)
        stream.resumed = bool(delivered_token_ids)
        self._streams[stream.seq_id] = stream
        self._where[stream.seq_id] = loop
        loop.wake()
        self._update_gauges()

    def abort(self, stream: GenerateStream) -> None:
        """The client went away: the sequence is dropped and its blocks freed now."""
        if not self._finish(stream.seq_id):
            return
        self._drop(stream.seq_id)

    def hand_over(self, stream: GenerateStream, error: errors.InfermeshError) -> bool:
        """Ends the stream with `error` (tokens already streamed stay delivered; nothing follows them)
        and drops its sequence, blocks freed now: the scheduler is draining and the caller resumes
        the stream elsewhere. False when it had already finished."""
        if not self._finish(stream.seq_id):
            return False
        self._drop(stream.seq_id)
        stream.events.put_nowait(StreamEvent(error=error))
        return True

    def _drop(self, seq_id: int) -> None:
        loop = self._where.pop(seq_id, None)
        if loop is not None:
            loop.scheduler.abort(seq_id, AbortReason.CANCELLED)
            loop.wake()  # tells the worker to forget the sequence even if nothing else runs
        self._held.pop(seq_id, None)
        self._update_gauges()

    # -- the step loop's callbacks --------------------------------------------

    def after_schedule(self, plan: StepPlan) -> None:
        now = self.clock()
        for seq_id in plan.expired_seq_ids:
            stream = self._streams.get(seq_id)
            if stream is not None:
                self._end(stream, _deadline_error(stream))
        if plan.preempted_seq_ids:
            self._preemptions.inc(len(plan.preempted_seq_ids))
        if not plan.seqs:
            return
        self._batch_size.observe(len(plan.seqs))
        for step in plan.seqs:
            if not step.reset_block_table:
                continue  # a sequence's first step always resets its block table: no lookup per decode
            stream = self._streams.get(step.seq_id)
            if stream is not None and stream.first_scheduled_s is None:
                stream.first_scheduled_s = now
                self._queue_time[stream.tenant.priority].observe(now - stream.arrival_s)

    def after_step(self, loop: _WorkerLoop, plan: StepPlan, outcome: StepOutcome,
                   step_time_s: float | None = None) -> list[SequenceDelta]:
        """Applies the worker's result (what the next step depends on); returns the chunks to deliver()."""
        deltas = loop.scheduler.update_from_output(plan, outcome.token_ids, step_time_s)
        for delta in deltas:
            if delta.abort_reason is not None:
                self._failures[delta.seq_id] = outcome.failures.get(delta.seq_id,
                                                                    "the worker returned no valid token")
        return deltas

    def account_step(self, plan: StepPlan, outcome: StepOutcome) -> None:
        """Bookkeeping of a finished step that no next step waits for: compute time per stream, gauges."""
        compute_s = outcome.worker_total_s
        streams = self._streams
        for step in plan.seqs:
            stream = streams.get(step.seq_id)
            if stream is not None:
                stream.compute_s += compute_s
        self._update_gauges()

    def observe_step(self, round_trip_s: float, worker_s: float, scheduler_gap_s: float) -> None:
        """One step's timing: the worker's own time, and the overhead around it (the scheduler's time
        from the previous result to this step's send, plus the round trip beyond the worker's time)."""
        self._step_time.observe(round_trip_s + scheduler_gap_s)

        self._step_overhead.observe(max(0.0, round_trip_s - worker_s) + scheduler_gap_s)

    def deliver(self, deltas: list[SequenceDelta]) -> None:
        """Streams one step's chunks to their clients (ending failed sequences with an error)."""
        if not deltas:
            return
        now = self.clock()
        # Inter-token gaps of this step by value: the step's streams mostly share their last chunk's
        # time, so one histogram update per distinct gap instead of one per token.
        gaps: dict[float, int] = {}
        for delta in deltas:
            self._deliver(delta, now, gaps)
        for gap_s, count in gaps.items():
            metrics.observe_many(self._inter_token, gap_s, count)

    # -- internals ---------------------------------------------------------

    def _deliver(self, delta: SequenceDelta, now: float, gaps: dict[float, int]) -> None:
        stream = self._streams.get(delta.seq_id)
        reason = self._failures.pop(delta.seq_id, None) if delta.abort_reason is not None else None
        if stream is None:
            return
        if delta.abort_reason is not None:
            self._end(stream, errors.Internal(f"worker failed sequence {delta.seq_id}: {reason}"))
            return
        self._observe_token_times(stream, delta, now, gaps)
        stream.events.put_nowait(StreamEvent(delta=delta))
        if delta.is_last:
            self._finish(delta.seq_id)
            self._where.pop(delta.seq_id, None)

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

    def _end(self, stream: GenerateStream, error: errors.InfermeshError) -> None:
        if self._finish(stream.seq_id):
            self._where.pop(stream.seq_id, None)
            stream.events.put_nowait(StreamEvent(error=error))

    def _finish(self, seq_id: int) -> bool:
        """Forgets the stream; False if it had already finished."""
        stream = self._streams.pop(seq_id, None)
        if stream is None or stream.finished:
            return False
        stream.finished = True
        return True

    def _usable_loops(self) -> list[_WorkerLoop]:
        return [loop for loop in self._loops.values() if loop.link.usable]

    def _note_prefilling(self, seq: Sequence, route: Route[_WorkerLoop]) -> None:
        if self._router.mode is RoutingMode.CACHE_AWARE:
            self._prefilling[seq.seq_id] = (route.worker, seq, route.num_cached_tokens)

    def _views(self, loops: list[_WorkerLoop]) -> list[WorkerView[_WorkerLoop]]:
        """What routing knows of each worker: its load, and its block manager for cached prefixes.

        Prompt tokens still to compute are summed over the sequences routed that have not finished
        their prefill (dropped here once they have, or left): the waiting queue, not every sequence.
        One holding no blocks yet counts its tokens less what routing found cached for it, since
        the step scheduler looks its prefix up only when it admits it. A sequence preempted after
        its prefill is not counted again (rare, and it recomputes on the worker it is on)."""
        num_prefill = dict.fromkeys(loops, 0)
        done = []
        for seq_id, (where, seq, num_cached) in self._prefilling.items():
            num_uncomputed = seq.num_uncomputed_tokens
            if num_uncomputed <= 1 or seq.is_finished() or self._where.get(seq_id) is not where:
                done.append(seq_id)  # decoding (one token a step), finished, or moved
            elif where in num_prefill:
                num_prefill[where] += max(0, num_uncomputed - (num_cached if seq.num_computed_tokens == 0 else 0))
        for seq_id in done:
            del self._prefilling[seq_id]
        views = []
        for loop in loops:
            scheduler = loop.scheduler
            load = WorkerLoad(num_running=scheduler.num_running,
                              num_waiting=scheduler.num_unfinished - scheduler.num_running,
                              max_num_seqs=scheduler.config.max_num_seqs, num_prefill_tokens=num_prefill[loop],
                              kv_usage=scheduler.kv.usage)
            views.append(WorkerView(loop, load, scheduler.kv))
        return views

    def _place(self, seqs: list[Sequence]) -> None:
        """Hands evicted sequences to usable workers as `--routing` says (their generated tokens
        count as prompt: they are recomputed), or holds them."""
        loops = self._usable_loops()
        now = self.clock()
        for seq in seqs:
            if not loops:
                self._held[seq.seq_id] = (seq, now)
                continue
            route = self._router.choose(seq.token_ids(0, seq.num_tokens), seq.tenant.tenant_id, self._views(loops))
            loop = route.worker
            loop.scheduler.adopt(seq, route.block_hashes)
            self._note_prefilling(seq, route)
            self._where[seq.seq_id] = loop
            loop.wake()
        if self._held and (self._hold_timer is None or self._hold_timer.done()):
            self._hold_timer = asyncio.create_task(self._expire_held(), context=clean_context())  # not the request's

    async def _expire_held(self) -> None:
        """Fails held sequences whose deadline (or the orphan grace) passes before a worker attaches."""
        grace_s = self.config.orphan_grace_ms / 1000
        while self._held:
            now = self.clock()
            next_s = None
            for seq_id, (seq, held_s) in list(self._held.items()):
                give_up_s = held_s + grace_s if seq.deadline_s is None else min(seq.deadline_s, held_s + grace_s)
                if now >= give_up_s:
                    del self._held[seq_id]
                    stream = self._streams.get(seq_id)
                    if stream is not None:
                        expired = seq.deadline_s is not None and now >= seq.deadline_s
                        self._end(stream, _deadline_error(stream) if expired else errors.Unavailable(
                            f"no worker serves model {self.model}", retry_after_s=1.0))
                else:
                    next_s = give_up_s if next_s is None else min(next_s, give_up_s)
            self._update_gauges()
            if next_s is not None:
                await self.sleep(max(0.0, next_s - now))

    def _update_gauges(self) -> None:
        schedulers = [loop.scheduler for loop in self._loops.values()]
        num_waiting = sum(s.num_waiting for s in schedulers) + len(self._held)
        running, waiting, queue_depth = self._gauges
        running.set(sum(s.num_running for s in schedulers))
        waiting.set(num_waiting)
        held = [seq for seq, _ in self._held.values()]
        for priority, gauge in queue_depth.items():
            gauge.set(sum(s.num_waiting_of(priority) for s in schedulers) + sum(s.priority == priority for s in held))
        for loop in self._loops.values():
            kv = loop.scheduler.kv
            loop.kv_gauge.set(kv.usage)
            loop.cache_metrics.publish(loop.scheduler.cache_stats, kv.num_cached_blocks, kv.num_evictions)


def _retrieve(future: asyncio.Future[StepOutcome]) -> None:
    if not future.cancelled():
        future.exception()


def _deadline_error(stream: GenerateStream) -> errors.DeadlineExceeded:
    seq = stream.seq
    if seq is None or seq.first_scheduled_s is None:
        return errors.DeadlineExceeded("deadline passed while waiting for admission")
    return errors.DeadlineExceeded(f"deadline passed after {seq.num_generated} tokens")
