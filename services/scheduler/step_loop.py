"""The step loop of one generator worker: plan -> send -> overlap -> await -> update.

Like vLLM's EngineCore.step() (schedule, execute, update_from_output), with the worker across a
stream:
- plan: `StepScheduler.schedule()` once the last result is applied; pipelined, also the steps
  `schedule_ahead()` plans behind those in flight (StepPacing says how many, and when);
- send: the steps go to the worker in one command (RunStep, or RunSteps for several);
- overlap: while the worker computes, what no next step waits for: the sent steps' metrics, and
  the last step's chunks and bookkeeping handed to the sink;
- await: the oldest step's result (or, while commands of several steps go, an arrival or the next
  command's time, whichever comes first: then plan again);
- update: `update_from_output()`, which the next plan depends on; its chunks wait for the overlap.

The loop knows its pool only as a `StepSink`: where planned steps and results go. Failover is the
pool's: when the worker's stream breaks the loop just stops, and the pool evicts its sequences.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from services.common.clock import Clock
from services.scheduler.attach_types import (
    StepCommand,
    StepOutcome,
    StepsCommand,
    StepSequenceContext,
    WorkerCapacity,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.metrics import StepMetrics
from services.scheduler.step_pacing import StepPacing
from services.scheduler.step_plan import SequenceDelta, StepPlan
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.worker_link import WorkerGone, WorkerLink

log = logging.getLogger(__name__)

# A scheduler with work but nothing it may run now (rare: admission blocked) looks again this often.
_BLOCKED_POLL_S = 0.01


class StepSink(Protocol):
    """Where one worker's steps are reported: all the step loop knows of its pool."""

    def planned(self, plan: StepPlan) -> None:
        """A step was planned (sent or not): its expired sequences' streams end."""

    def completed(self, plan: StepPlan, outcome: StepOutcome, deltas: list[SequenceDelta]) -> None:
        """A step's result was applied: its bookkeeping, and its chunks to the clients."""


@dataclasses.dataclass
class SentStep:
    plan: StepPlan
    result: asyncio.Future[StepOutcome]
    sent_at_s: float
    # Its place among the steps sent in one command, and their number: their results come back together.
    index_in_command: int = 0
    command_size: int = 1


def steps_per_command(config: SchedulerConfig, capacity: WorkerCapacity) -> int:
    """Most decode steps a pipelined worker loop sends in one command (1: one per command)."""
    return max(1, min(config.steps_per_command, capacity.max_steps_per_command, capacity.max_steps_in_flight // 2))


def is_pipelined(config: SchedulerConfig, capacity: WorkerCapacity) -> bool:
    """Whether a worker gets its next step before the last one's result (`--pipelined-steps`, and a worker
    that takes two steps at once)."""
    return config.pipelined_steps and capacity.max_steps_in_flight >= 2


class WorkerLoop:
    """One generator worker's step loop (module docstring), and the handle its pool keeps of the worker."""

    def __init__(self, link: WorkerLink, scheduler: StepScheduler, sink: StepSink, *,
                 sequences: Mapping[int, StepSequenceContext], step_metrics: StepMetrics, pipelined: bool,
                 steps_per_command: int, clock: Clock, sleep: Callable[[float], Awaitable[None]]) -> None:
        """`sequences`: what each command carries of its sequences (the pool's streams, by seq_id);
        `sleep`: waits out `clock` seconds (a fake clock's in tests)."""
        self.link = link
        self.scheduler = scheduler
        self.attached = True
        self.pipelined = pipelined
        self._sink = sink
        self._sequences = sequences
        self._metrics = step_metrics
        self._clock = clock
        self._pacing = StepPacing(steps_per_command if pipelined else 1, clock, sleep)
        self._in_flight: deque[SentStep] = deque()
        # The last step, its outcome and its chunks, until handed out by _flush().
        self._done: tuple[StepPlan, StepOutcome] | None = None
        self._deltas: list[SequenceDelta] = []
        self.task = asyncio.create_task(self.run())

    def wake(self) -> None:
        """Something changed that the next plan must see: a sequence arrived or left, the worker drains
        or is gone."""
        self._pacing.wake()

    async def run(self) -> None:
        try:
            await self._run()
        except Exception:
            # Nobody awaits this task: without this line its death showed only when it was collected,
            # and the worker's sequences waited, unstepped, until the worker left.
            log.exception("step loop of worker %s failed", self.link.worker_id)
            raise
        finally:
            self._pacing.disarm()
            # Chunks of a step already applied go out whatever ends the loop: their tokens are the
            # sequences' (a recompute elsewhere goes on after them), so withholding them is a gap.
            self._flush()

    async def _run(self) -> None:
        while self.attached:
            if not self._in_flight and not self.scheduler.has_work():
                if not await self._rest():
                    return
                continue
            sent = self._plan_and_send()
            if not self._in_flight:  # the step planned had nothing to run
                if self.link.closed.is_set():
                    return  # remove_worker() evicts this worker's sequences to the others
                if self.scheduler.has_work():
                    await self._pacing.sleep(_BLOCKED_POLL_S)
                continue
            await self._overlap(sent)
            oldest = self._in_flight[0]
            if not await self._result_first(oldest):
                continue  # the next command is due, or a sequence arrived: plan again
            try:
                outcome = await oldest.result
            except WorkerGone:
                return  # remove_worker() evicts every sequence, those of all steps in flight included
            if not self.attached or self.link.closed.is_set():
                # The stream ended; remove_worker() evicts every sequence at its next turn. A result that
                # came with the end is not applied (the recompute elsewhere computes it again): applied,
                # the loop would go on planning steps the closed link refuses (kept in flight by the
                # StepScheduler, not by this loop: its next schedule() raised RuntimeError).
                return
            self._in_flight.popleft()
            self._update(oldest, outcome)

    # -- plan -> send ----------------------------------------------------------

    def _plan_and_send(self) -> list[StepPlan]:
        """Plans and sends the next step once nothing is in flight, then, pipelined, the steps planned
        ahead; returns those sent. A first step with nothing to send is reported at once."""
        sent = []
        if not self._in_flight:
            # Critical path: from the last result to this send, only what the next step needs.
            plan = self.scheduler.schedule()
            if not self._send((plan,)):
                self._report_unsent(plan)
                return []
            sent.append(plan)
        if self.pipelined:
            sent.extend(self._send_ahead())
        return sent

    def _send_ahead(self) -> list[StepPlan]:
        """Steps planned ahead of those in flight, sent as one command, as many as StepPacing says now."""
        newest = self._in_flight[-1]
        num_steps = self._pacing.steps_to_send(bool(self.scheduler.num_waiting), len(self._in_flight),
                                               newest.command_size)
        plans: list[StepPlan] = []
        while len(plans) < num_steps and (ahead := self.scheduler.schedule_ahead()) is not None:
            plans.append(ahead)
        if not plans or not self._send(tuple(plans)):
            return []
        self._metrics.sent_ahead(len(plans))
        return plans

    def _send(self, plans: tuple[StepPlan, ...]) -> bool:
        """Puts the steps on their way to the worker, in one command; False when the first has nothing to
        run or the worker is gone."""
        if not plans[0].has_work():
            return False
        try:
            if len(plans) == 1:
                results = [self.link.run_step(StepCommand(plans[0], self._sequences))]
            else:
                results = self.link.run_steps(StepsCommand(plans, self._sequences))
        except WorkerGone:
            return False
        now = self._clock()
        self._pacing.sent(now)
        for index, (plan, result) in enumerate(zip(plans, results, strict=True)):
            # A step behind the one whose failure ends the loop is never awaited: its WorkerGone is expected.
            result.add_done_callback(_retrieve)
            self._in_flight.append(SentStep(plan, result, now, index, len(plans)))
        return True

    def _report_unsent(self, plan: StepPlan) -> None:
        """A step with nothing sent: still planned (expiries), and the worker still forgets finished
        sequences."""
        self._planned(plan)
        self._flush()
        if plan.finished_seq_ids:
            self.link.abort(plan.finished_seq_ids)

    # -- overlap ---------------------------------------------------------------

    async def _overlap(self, sent: list[StepPlan]) -> None:
        """While the worker computes: the sent steps' metrics, and the last step's chunks to the clients."""
        if sent:
            await asyncio.sleep(0)  # the Attach writer puts the steps on the wire first
        for plan in sent:
            self._planned(plan)
        self._flush()

    def _planned(self, plan: StepPlan) -> None:
        self._sink.planned(plan)
        self._metrics.planned(len(plan.seqs), len(plan.preempted_seq_ids))

    def _flush(self) -> None:
        """The last step's bookkeeping and chunks, once."""
        if self._done is not None:
            plan, outcome = self._done
            self._sink.completed(plan, outcome, self._deltas)
            self._done = None
            self._deltas = []

    # -- await -> update -------------------------------------------------------

    async def _result_first(self, oldest: SentStep) -> bool:
        """Whether `oldest`'s result comes before the next command is due or a sequence arrives (only
        waited for while StepPacing says they count); False: plan again."""
        if oldest.result.done() or not self._pacing.waits_on_more_than_results(self._in_flight[-1].command_size):
            return True
        # A sequence arriving while steps are in flight gets its first step in right behind them.
        if self._pacing.arrived():
            return False  # one arrived since the steps were planned
        await asyncio.wait((oldest.result, self._pacing.due()), return_when=asyncio.FIRST_COMPLETED)
        return oldest.result.done()

    def _update(self, step: SentStep, outcome: StepOutcome) -> None:
        """Applies the worker's result (what the next step depends on); its chunks wait for _flush()."""
        timing = self._pacing.on_result(step.sent_at_s, step.index_in_command, step.command_size)
        self._metrics.timed(timing.took_s, outcome.worker_total_s, timing.gap_s)
        self._deltas = self.scheduler.update_from_output(step.plan, outcome.token_ids, timing.share_s,
                                                          outcome.logprobs, outcome.prompt_logprobs,
                                                          outcome.embeddings)
        self._done = (step.plan, outcome)

    # -- rest ------------------------------------------------------------------

    async def _rest(self) -> bool:
        """Nothing in flight and nothing to run: hands out the last step's chunks, then waits for work,
        and for the sequences arriving right behind the first (StepPacing.gather). False: a draining
        worker is done, and its stream ended."""
        self._flush()
        self._pacing.idle()
        if self.link.draining:
            self.link.end_stream()
            return False
        await self._pacing.sleep(None)
        if self.scheduler.has_work():
            await self._pacing.gather()
        return True


def _retrieve(future: asyncio.Future[StepOutcome]) -> None:
    if not future.cancelled():
        future.exception()
