"""The worker's end of Scheduler.Attach: dial, say hello, run commands, re-dial on loss.

One client holds one Attach stream at a time. A generator worker, given several schedulers, is
attached to one of them, picked by a `dialer` (scheduler_dialer.py: fewest workers of our model
first); when its stream breaks or the scheduler drains it, it re-dials at once, another scheduler
first, and backs off only when no scheduler took it. It moves to a scheduler that has none of our
model's workers, from one with two or more, at once (scheduler_endpoints.EmptySchedulerMove): it
says Draining, finishes the steps it was sent and half-closes the stream; the scheduler resumes
its sequences on its other workers (the same recompute as when a worker dies, with nothing lost),
and the worker dials the empty scheduler. A classifier worker runs one client per
scheduler instead, each with a fixed address (attach_every.py): its clients re-dial their own
scheduler with the backoff alone.

Commands run one at a time (one model, one device stream). Classify batches run
on a compute thread, so the loop reads the prefetched next batch meanwhile.
Generate steps run on the event loop itself, one at a time in the order received: the
thread hand-off cost ~0.2 ms of every step's critical path (read -> compute start
went from 0.28 to 0.07 ms at 32 sequences); heartbeats and aborts wait for the step
to end, which is when the next step would see them anyway. A scheduler may send the next
step before this one's result (pipelined steps, WorkerCapacity.max_steps_in_flight): it
waits in the stream and runs as soon as this one is done, its decodes taking this step's samples. A runtime may instead return an
awaitable result (one that waits on a timer or a device rather than the CPU); the loop then
serves heartbeats and aborts while it waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import random
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc

from infermesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import tls
from services.common.log_context import bind
from services.common.protocol import TOKENIZER_FILE_CHUNK_BYTES
from services.common.telemetry import context_from_carrier, record_stages_under, tracer
from services.common.timings import from_proto
from services.worker import metrics
from services.worker.expired_items import split_expired
from services.worker.runtime import BatchRuntime, SendsTokenizerFile, StepRuntime, WorkerRuntime
from services.worker.scheduler_endpoints import (
    EmptySchedulerMove,
    EndpointLoad,
    LookAgain,
    MoveNow,
    empty_target,
    is_unsettled,
    move_probability,
)

log = logging.getLogger(__name__)
_tracer = tracer("infermesh.worker")


class Backoff:
    """Exponential backoff with full jitter (the AWS architecture blog's variant)."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self._initial_s = initial_s
        self._max_s = max_s
        self._attempt = 0
        self._rng = rng or random.Random()

    def next_delay_s(self) -> float:
        ceiling_s = min(self._max_s, self._initial_s * 2**self._attempt)
        self._attempt += 1
        return self._rng.uniform(0, ceiling_s)

    def reset(self) -> None:
        self._attempt = 0


# HTTP/2 keepalive on the Attach stream: a scheduler cut off without a reset (a partition, a frozen
# host) sends nothing an idle worker would miss, so only an unanswered ping shows it is gone (by
# default in at most ~20 s, then the worker re-dials another). Every 15 s by default: the schedulers
# accept pings 10 s apart when they send no data (services/common/server.py), so these never count
# as ping abuse.
def attach_channel_options(keepalive_ms: int = 15_000) -> tuple[tuple[str, int], ...]:
    timeout_ms = keepalive_ms // 3
    return (
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # This grpc's keepalive waits this one (default 60 s) for the ack, not keepalive_timeout_ms alone.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Without it a ping after one sent earlier (e.g. a BDP probe) waits 5 min for the peer to send data.
        ("grpc.http2.min_time_between_pings_ms", keepalive_ms * 2 // 3),
    )


class Dialer(Protocol):
    @property
    def has_choice(self) -> bool:
        """Whether there is more than one scheduler to attach to (else no rebalancing)."""
        ...

    async def dial_order(self, avoid: str | None = None) -> list[str]:
        """Scheduler addresses to try, best first (`avoid`, the one just left, last)."""
        ...

    async def loads(self) -> list[EndpointLoad]:
        """Each scheduler's workers of our model now (None: it did not answer)."""
        ...

    async def serving(self, address: str) -> bool:
        """Whether that scheduler says it is serving (not draining, not starting)."""
        ...


class FixedAddress:
    """A dialer for one scheduler address (tests, and the single-scheduler case)."""

    has_choice = False

    def __init__(self, address: str) -> None:
        self._address = address

    async def dial_order(self, avoid: str | None = None) -> list[str]:
        return [self._address]

    async def loads(self) -> list[EndpointLoad]:
        return []

    async def serving(self, address: str) -> bool:
        return True


# While a scheduler is missing (lost, restarting) or a move is due, the rebalance check runs this
# often instead of every rebalance interval: full jitter up to a cap of 0.5 s, so a scheduler that
# comes back has a worker within about a second (it took 2.5-7.5 s at the interval alone) and
# every worker of a model does not probe at once. A probe is one GetPressure per scheduler.
UNSETTLED_INITIAL_S = 0.05
UNSETTLED_MAX_S = 0.5


# Sent as Draining.grace_ms when the worker moves to another scheduler: it finishes what it holds
# there however long that takes (the scheduler ends the stream when it is done).
_MOVE_GRACE_MS = 60_000


# A move to an empty scheduler waits this long at most for the steps the worker was sent before it
# half-closes the stream (what it has not answered by then is recomputed on the scheduler's other
# workers), and this long for the scheduler to end the stream after that before cancelling it.
HAND_OVER_STEPS_S = 1.0
HAND_OVER_CLOSE_S = 5.0


# An attached session shorter than this is followed by backoff like a refusal: a scheduler that
# welcomes workers and drops them at once must not be re-dialled in a hot loop.
MIN_SESSION_S = 1.0


class AttachClient:
    def __init__(self, dialer: Dialer | str, runtime: WorkerRuntime, worker_id: str, backoff: Backoff,
                 clock=time.monotonic, rebalance_interval_s: float = 0.0, rng: random.Random | None = None,
                 keepalive_ms: int = 15_000, unsettled_backoff: Backoff | None = None,
                 compute: ThreadPoolExecutor | None = None) -> None:
        """`rebalance_interval_s`: how often (jittered 0.5-1.5x) an attached worker checks whether to move
        to a scheduler with fewer workers of its model; 0: never. `unsettled_backoff`: the delays
        between checks instead while another scheduler is missing or a move is due. `compute`: the
        thread classify batches run on, shared by the clients of one worker (attach_every.py); its
        owner shuts it down. None: a thread of this client's own."""
        self._dialer = FixedAddress(dialer) if isinstance(dialer, str) else dialer
        self._clock = clock
        self._rebalance_interval_s = rebalance_interval_s
        self._rng = rng or random.Random()
        self._unsettled_backoff = unsettled_backoff or Backoff(UNSETTLED_INITIAL_S, UNSETTLED_MAX_S, self._rng)
        self._address = ""  # the scheduler dialled last
        self._runtime = runtime
        # A command for the other kind of runtime is answered with errors, never run (_guarded_*).
        self._batch_runtime = runtime if isinstance(runtime, BatchRuntime) else None
        self._step_runtime = runtime if isinstance(runtime, StepRuntime) else None
        self._worker_id = worker_id
        self._backoff = backoff
        self._channel_options = attach_channel_options(keepalive_ms)
        self._owns_compute = compute is None
        self._compute = compute or ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._call: grpc.aio.StreamStreamCall | None = None
        self._write_lock = asyncio.Lock()
        # Generate steps take their turns, each until its result is written (see _step).
        self._step_turn = asyncio.Lock()
        self._in_flight: set[asyncio.Task] = set()
        self._stopping = False
        self._empty_move = EmptySchedulerMove(worker_id, clock, self._rng)
        # Set by a move to an empty scheduler: no further work is taken on this stream
        # (_leaving), and run() re-dials at once, however short the session was (_moved).
        self._leaving = False
        self._moved = False
        self.attached = asyncio.Event()
        self.num_attaches = 0
        self._num_failed_rounds = 0  # backoff rounds since the last attach (for the log level)
        self._model_label = ""

    @property
    def address(self) -> str:
        """The scheduler this worker dialled last (attached to, while `attached` is set)."""
        return self._address

    async def run(self) -> None:
        """Attach, and re-attach after every break, until drained: at once (another scheduler first)
        after a session that was attached; with backoff when no scheduler took us."""
        left: str | None = None
        while not self._stopping:
            was_attached, began_s = False, self._clock()
            for address in await self._dialer.dial_order(left):
                began_s = self._clock()
                was_attached = await self._attach_to(address)
                if was_attached or self._stopping:
                    left = address
                    break
            self.attached.clear()
            if self._stopping:
                break
            moved, self._moved = self._moved, False
            if was_attached and (moved or self._clock() - began_s >= MIN_SESSION_S):
                log.info("re-dialling at once")
                continue
            delay_s = self._backoff.next_delay_s()
            self._num_failed_rounds += 1
            log.log(self._repeat_level(), "no scheduler took us (for long); re-dialling in %.2fs", delay_s)
            await asyncio.sleep(delay_s)

    async def _attach_to(self, address: str) -> bool:
        """One Attach session with `address`; True when it was attached (welcomed), however it ended."""
        self._address = address
        num_attaches = self.num_attaches
        try:
            await self._session()
        except grpc.aio.AioRpcError as exc:
            level = logging.WARNING if self.num_attaches > num_attaches else self._repeat_level()
            log.log(level, "attach stream to %s broke: %s %s", address, exc.code().name, exc.details())
        except ConnectionError as exc:
            log.warning("attach stream to %s broke: %s", address, exc)
        return self.num_attaches > num_attaches

    def _repeat_level(self) -> int:
        """A scheduler that stays down is re-dialled every <= --reconnect-max-s: the first failed
        round is a warning, the ones after it until the next attach are DEBUG (no log flood)."""
        return logging.WARNING if self._num_failed_rounds <= 1 else logging.DEBUG

    async def _session(self) -> None:
        async with tls.aio_channel(self._address, options=self._channel_options) as channel:
            call = scheduler_pb2_grpc.SchedulerStub(channel).Attach()
            hello = self._runtime.hello(self._worker_id)
            self._model_label = f"{hello.model.name}:{hello.model.version}"
            await call.write(scheduler_pb2.WorkerMessage(hello=hello))
            for piece in _tokenizer_file_pieces(self._runtime):
                await call.write(scheduler_pb2.WorkerMessage(tokenizer_file=scheduler_pb2.TokenizerFile(data=piece)))
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("kind") != "welcome":
                raise ConnectionError("scheduler closed the stream without a welcome")
            # Only an attached stream is drained through; a dial in progress is simply abandoned.
            self._call = call
            self._leaving = False
            self._empty_move.reset()
            self._backoff.reset()
            self._num_failed_rounds = 0
            self.num_attaches += 1
            self.attached.set()
            log.info("attached to scheduler %s at %s as %s", first.welcome.scheduler_id, self._address, self._worker_id)
            heartbeat = asyncio.create_task(self._heartbeats(call, first.welcome.heartbeat_interval_ms / 1000 or 1.0))
            rebalance = (asyncio.create_task(self._rebalance(call))
                         if self._rebalance_interval_s > 0 and self._dialer.has_choice else None)
            try:
                await self._read_commands(call)
            finally:
                heartbeat.cancel()
                if rebalance is not None:
                    rebalance.cancel()
                self._call = None
                # Whichever scheduler we attach to next recomputes what it wants from scratch
                # (first steps reset their block tables); the ids of this session mean nothing there.
                if self._step_runtime is not None:
                    self._step_runtime.forget_all()
                metrics.observe_kv_blocks(self._model_label, self._kv_blocks_used())

    async def _read_commands(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            command = await call.read()
            if command is grpc.aio.EOF:
                await self._wait_in_flight()
                return
            kind = command.WhichOneof("kind")
            if self._leaving and kind in ("execute_batch", "run_step", "run_steps"):
                continue  # moving off: the scheduler recomputes it on its other workers
            if kind == "execute_batch":
                self._spawn(self._execute(call, command.execute_batch))
            elif kind == "run_step":
                self._spawn(self._steps(call, (command.run_step,)))
            elif kind == "run_steps":
                self._spawn(self._steps(call, tuple(command.run_steps.steps), together=True))
            elif kind == "abort" and self._step_runtime is not None:  # a batch runtime holds nothing between batches
                self._step_runtime.abort(command.abort)
                # The freed blocks show now, not at the next step (there may be none for a while).
                metrics.observe_kv_blocks(self._model_label, self._kv_blocks_used())
            elif kind == "drain":
                log.info("scheduler asked to drain; finishing in-flight work and re-dialling")
                await self._wait_in_flight()
                await call.done_writing()
                return

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    async def _execute(self, call, command: scheduler_pb2.ExecuteBatch) -> None:
        bind(batch_id=command.batch_id)  # a batch serves several requests: its lines name the batch
        began_ns = time.time_ns()
        # The compute thread logs with this task's fields (run_in_executor alone does not copy them).
        result = await asyncio.get_running_loop().run_in_executor(
            self._compute, contextvars.copy_context().run, _guarded_batch, self._batch_runtime, command)
        if inspect.isawaitable(result):
            result = await _awaited_batch(result, command)
        await self._write(call, scheduler_pb2.WorkerMessage(batch_result=result))
        log.debug("batch of %d items done", len(command.items))
        metrics.observe_batch(self._model_label, result)
        _trace_work("worker.execute_batch", began_ns, result.timings, [i.trace_context for i in command.items],
                    {"infermesh.batch_size": len(command.items)})

    async def _steps(self, call, commands: tuple[scheduler_pb2.RunStep, ...], together: bool = False) -> None:
        """Runs the steps in order and answers them: one StepResult each, or (`together`: a RunSteps
        command) one StepResults for all. Back to back, the steps after the first find the caches as the
        model left them: on tinylm a step right after another took 1.0 ms, one after the messages
        between steps 1.2 ms (2026-11-27, before the step itself got cheaper)."""
        if not commands:
            return
        bind(batch_id=f"step-{commands[0].step_id}")
        # A step the scheduler sent ahead (pipelined) starts once this one's result is written: its
        # compute holds the event loop, and a result whose write has not completed waited in the
        # stream for the whole next step (then the scheduler's next step waited for it in turn, and
        # the worker idled a round trip per step as if nothing were pipelined; measured on tinylm).
        async with self._step_turn:
            done = []
            for command in commands:
                began_ns = time.time_ns()
                result = _guarded_step(self._step_runtime, command)
                if inspect.isawaitable(result):
                    result = await _awaited_step(result, command)
                done.append((command, result, began_ns))
            if together:
                message = scheduler_pb2.WorkerMessage()
                message.step_results.results.extend(result for _, result, _ in done)
            else:
                message = scheduler_pb2.WorkerMessage(step_result=done[0][1])
            await self._write(call, message)
        for command, result, began_ns in done:
            metrics.observe_step(self._model_label, command, result, self._kv_blocks_used())
            _trace_work("worker.run_step", began_ns, result.timings, [s.trace_context for s in command.seqs],
                        {"infermesh.num_seqs": len(command.seqs)})

    async def _rebalance(self, call) -> None:
        """Now and then: move, gracefully, when this scheduler has 2+ workers of our model more than
        another (scheduler_endpoints.move_probability). The scheduler gives us no new work, lets what
        we hold finish, then ends the stream; run() then dials the emptiest scheduler at once. To a
        scheduler with none of our model's workers, from one with two or more, the move is at once
        instead (EmptySchedulerMove, _hand_over). The first look comes soon after attaching (the
        scheduler left may have been lost just now), and they stay frequent while `is_unsettled` (a
        scheduler missing may restart at any moment)."""
        delay_s = self._unsettled_backoff.next_delay_s()
        while True:
            await asyncio.sleep(delay_s)
            loads = await self._dialer.loads()
            empty_move = self._empty_move.look(loads, self._address)
            if isinstance(empty_move, LookAgain):
                delay_s = empty_move.delay_s
                continue
            if isinstance(empty_move, MoveNow):
                if await self._dialer.serving(empty_move.target):
                    # A last look right before leaving: another worker here that moved meanwhile
                    # is counted out by now, and the Draining below follows this answer closely.
                    loads = await self._dialer.loads()
                    if empty_target(loads, self._address, self._worker_id) == empty_move.target:
                        await self._hand_over(call, empty_move.target, loads)
                        return
                # Draining, not started, or filled meanwhile: gracefully moved or not, we would be
                # refused or surplus there. Soon again.
                delay_s = self._unsettled_backoff.next_delay_s()
                continue
            probability = move_probability(loads, self._address)
            if probability > 0 and self._rng.random() < probability:
                log.info("moving off scheduler %s to even out workers (%s)", self._address,
                         ", ".join(f"{load.address}={load.num_workers}" for load in loads))
                await self._write(call, scheduler_pb2.WorkerMessage(draining=scheduler_pb2.Draining(
                    grace_ms=_MOVE_GRACE_MS)))
                return
            delay_s = self.next_rebalance_delay_s(loads)

    async def _hand_over(self, call, target: str, loads: list[EndpointLoad]) -> None:
        """Leaves this scheduler now for `target`, which has no worker of our model. Draining first, so
        the scheduler counts us out at once (the other workers here, looking again, see one fewer and
        stay) and sends no new sequence; then the steps already received are answered, the stream
        half-closed, and the scheduler resumes what we held on its other workers. run() re-dials at
        once, the empty scheduler first."""
        log.info("moving off scheduler %s at once: %s has no worker of %s (%s)", self._address, target,
                 self._model_label, ", ".join(f"{load.address}={load.num_workers}" for load in loads))
        self._leaving = True
        self._moved = True
        await self._write(call, scheduler_pb2.WorkerMessage(draining=scheduler_pb2.Draining(grace_ms=0)))
        if self._in_flight:
            await asyncio.wait(set(self._in_flight), timeout=HAND_OVER_STEPS_S)
        async with self._write_lock:
            try:
                await call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                log.warning("could not half-close the stream to %s: %s", self._address, exc)
        # The scheduler ends the stream once it has read the half-close; this task is cancelled then.
        await asyncio.sleep(HAND_OVER_CLOSE_S)
        log.warning("scheduler %s did not end the stream %.0f s after we left; cancelling it", self._address,
                    HAND_OVER_CLOSE_S)
        call.cancel()

    def next_rebalance_delay_s(self, loads: list[EndpointLoad]) -> float:
        if is_unsettled(loads, self._address):
            return self._unsettled_backoff.next_delay_s()
        self._unsettled_backoff.reset()
        return self._rebalance_interval_s * self._rng.uniform(0.5, 1.5)

    async def _heartbeats(self, call, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            beat = scheduler_pb2.Heartbeat(
                sent_unix_us=int(time.time() * 1e6), num_kv_blocks_used=self._kv_blocks_used()
            )
            await self._write(call, scheduler_pb2.WorkerMessage(heartbeat=beat))

    def _kv_blocks_used(self) -> int:
        return self._step_runtime.kv_blocks_used() if self._step_runtime is not None else 0

    async def _write(self, call, message: scheduler_pb2.WorkerMessage) -> None:
        async with self._write_lock:
            try:
                await call.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                # The stream is gone; the scheduler re-queues this work elsewhere.
                log.warning("could not send %s: %s", message.WhichOneof("kind"), exc)

    async def _wait_in_flight(self) -> None:
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    async def drain(self, grace_s: float) -> None:
        """Tell the scheduler, finish what was sent, then close the stream and stop re-dialling."""
        self._stopping = True
        call = self._call
        if call is None:
            return
        await self._write(call, scheduler_pb2.WorkerMessage(draining=scheduler_pb2.Draining(grace_ms=int(grace_s * 1000))))
        # The scheduler stops sending work, and ends the stream once nothing of ours is in flight.
        try:
            async with asyncio.timeout(grace_s):  # not wait_for: it can swallow a cancellation on 3.11
                await self.attached_closed()
        except TimeoutError:
            log.warning("scheduler did not release the stream within %.1fs", grace_s)
        await self._wait_in_flight()

    async def attached_closed(self) -> None:
        while self._call is not None:
            await asyncio.sleep(0.02)

    def close(self) -> None:
        if self._owns_compute:
            self._compute.shutdown(wait=False, cancel_futures=True)


def _tokenizer_file_pieces(runtime: WorkerRuntime) -> list[bytes]:
    """tokenizer.json in the pieces the scheduler reads right after a TOKENIZER_KIND_HF hello."""
    data = runtime.tokenizer_file() if isinstance(runtime, SendsTokenizerFile) else b""
    return [data[at:at + TOKENIZER_FILE_CHUNK_BYTES] for at in range(0, len(data), TOKENIZER_FILE_CHUNK_BYTES)]


def _trace_work(name: str, began_ns: int, timings, carriers, attributes: dict) -> None:
    """One span per request the batch/step served, under that request's own trace. A decode step's
    sequences carry no trace context (the scheduler sends it with prompt steps): nothing to do."""
    if not any(carriers):
        return
    ended_ns = time.time_ns()
    stages = [(stage.stage, stage.duration_us) for stage in from_proto(timings)]
    for carrier in carriers:
        if carrier:
            record_stages_under(_tracer, name, began_ns, ended_ns, context_from_carrier(carrier), stages, attributes)


INTERNAL = 13  # google.rpc.Code


class WrongKindOfWork(Exception):
    """A scheduler sent a command of the other kind (it sends work by the hello's kind, so: a bug there)."""


def _failed_batch(command: scheduler_pb2.ExecuteBatch, exc: Exception) -> scheduler_pb2.BatchResult:
    log.error("batch %d failed", command.batch_id, exc_info=exc)
    error = scheduler_pb2.ItemError(code=INTERNAL, message=f"worker failed the batch: {exc}")
    return scheduler_pb2.BatchResult(
        batch_id=command.batch_id,
        items=[scheduler_pb2.ItemResult(item_id=item.item_id, error=error) for item in command.items],
    )


def _failed_step(command: scheduler_pb2.RunStep, exc: Exception) -> scheduler_pb2.StepResult:
    log.error("step %d failed", command.step_id, exc_info=exc)
    error = scheduler_pb2.ItemError(code=INTERNAL, message=f"worker failed the step: {exc}")
    return scheduler_pb2.StepResult(
        step_id=command.step_id,
        outputs=[scheduler_pb2.SequenceOutput(seq_id=seq.seq_id, error=error) for seq in command.seqs],
    )


def _guarded_batch(runtime: BatchRuntime | None, command: scheduler_pb2.ExecuteBatch):
    """A runtime failure fails every item of the batch, never the stream (the scheduler would wait forever).
    Items already past their deadline are answered, not computed. `runtime` None: this worker's model
    runs steps, not batches."""
    live, expired = split_expired(command, time.time_ns() // 1000)
    if not live.items:
        return scheduler_pb2.BatchResult(batch_id=command.batch_id, items=expired)
    try:
        if runtime is None:
            raise WrongKindOfWork("this worker's model is a generator: it cannot classify")
        result = runtime.execute_batch(live)
    except Exception as exc:  # noqa: BLE001 - reported per item, and logged
        result = _failed_batch(live, exc)
    if not expired:
        return result
    if inspect.isawaitable(result):
        return _with_expired(result, expired)
    result.items.extend(expired)
    return result


async def _with_expired(pending: Awaitable[scheduler_pb2.BatchResult],
                        expired: list[scheduler_pb2.ItemResult]) -> scheduler_pb2.BatchResult:
    result = await pending
    result.items.extend(expired)
    return result


def _guarded_step(runtime: StepRuntime | None, command: scheduler_pb2.RunStep):
    """`runtime` None: this worker's model runs batches, not steps."""
    try:
        if runtime is None:
            raise WrongKindOfWork("this worker's model is a classifier: it cannot run generation steps")
        return runtime.run_step(command)
    except Exception as exc:  # noqa: BLE001 - reported per sequence, and logged
        return _failed_step(command, exc)


async def _awaited_batch(pending: Awaitable[scheduler_pb2.BatchResult],
                         command: scheduler_pb2.ExecuteBatch) -> scheduler_pb2.BatchResult:
    try:
        return await pending
    except Exception as exc:  # noqa: BLE001 - reported per item, and logged
        return _failed_batch(command, exc)


async def _awaited_step(pending: Awaitable[scheduler_pb2.StepResult],
                        command: scheduler_pb2.RunStep) -> scheduler_pb2.StepResult:
    try:
        return await pending
    except Exception as exc:  # noqa: BLE001 - reported per sequence, and logged
        return _failed_step(command, exc)
