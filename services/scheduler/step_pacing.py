"""When one worker's step loop plans again: a result, an arrival, or the next command's time.

After an idle spell the first step waits while sequences keep arriving (`gather()`, a fraction of
a step and GATHER_MAX_S at most; not at all before the loop's first result), so that streams sent
together start in one step.

A pipelined loop sends the steps it plans ahead `steps_per_command` (K) at a time in one command
while no sequence waits for a slot: the first step after an idle spell goes alone, then one more
until its result is back (planned FIRST_AHEAD_AT of the last step time measured after the first
left, so that streams arriving together, a few ms apart, share it), then K more, and
the next K once the worker has about one step and COMMAND_LEAD_S left of those in flight, timed by
the per-step time of the last command of several steps. A sequence arriving meanwhile (`wake()`)
gets its first step planned at once, right behind the steps in flight. While commands of one step go,
only results drive the loop: each result plans the next step, and waiting on more would cost every
step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.common.clock import Clock

# A command of several steps leaves when the worker has one step and this long left of the steps in
# flight (planning it and its trip take less), so the worker never waits for it and a newcomer finds
# no more than that ahead of its first step.
COMMAND_LEAD_S = 0.001

# After an idle spell the step behind the first is planned this far into the first (by the last step
# time measured): sent at once, it held only the first arrival, and the streams arriving a few ms
# behind it waited one more step for their prefill (bench_hf_llm --quick: 34 steps a round, not 33).
# Half a step leaves it on time even when the first step is twice as fast as the estimate (a lone
# step, or a quieter box); later than that it costs the worker one round trip, no more.
FIRST_AHEAD_AT = 0.5

# After an idle spell the first step waits while sequences keep arriving, each within GATHER_GAP_AT
# of the last step time of the one before, GATHER_MAX_AT of it in all: streams that arrive together
# land a few ms apart, and the first one's step alone made the round one step longer than their
# prefills together (bench_hf_llm --quick: 33 steps, not 32). A lone arrival waits GATHER_GAP_AT of a
# step for its first token, once (vLLM's scheduler delay factor holds prompts the same way).
GATHER_GAP_AT = 0.1
GATHER_MAX_AT = 0.25
# ... and never longer than this, whatever the step time: the last step time is a round trip, and a
# stall while a step was in flight (a scheduler stopped, as make chaos stops one for 5 s; a worker
# that hung) measures as one step of that length; if an idle spell followed, a lone arrival would
# wait a tenth of it (0.5 s) and a stream of them a quarter (1.25 s). Streams sent together land a
# few ms apart.
GATHER_MAX_S = 0.05


@dataclass(frozen=True)
class StepTiming:
    """What one step took, as the loop saw it."""

    # Its round trip from when the worker could start it, or its share of its command's.
    took_s: float
    # The scheduler's time from the previous result to this step's send (0 for a step sent ahead).
    gap_s: float
    # Its share of a command of several steps, whose results came back together; None: sent alone.
    share_s: float | None


class StepPacing:
    """The wake-ups and timers of one worker's step loop, and the step times they are paced by."""

    def __init__(self, steps_per_command: int, clock: Clock, sleep: Callable[[float], Awaitable[None]]) -> None:
        """`sleep`: waits out `clock` seconds (a fake clock's in tests)."""
        self.steps_per_command = steps_per_command
        self._clock = clock
        self._sleep = sleep
        self._arrived = False  # wake() came since the loop last looked
        # Done on wake() or a timer on the injected sleep, while sleep() or gather() waits on it.
        self._woken: asyncio.Future[None] | None = None
        # Set when the next command of several steps is due (a timer), or a sequence arrives meanwhile.
        self._due: asyncio.Future[None] | None = None
        self._due_timer: asyncio.Task[None] | None = None
        self._command_step_s = 0.0  # per step, of the command whose results are being applied
        self._result_at_s: float | None = None  # when the last step's result came back
        # The last step's time, kept over idle spells: it times the step behind the first after one.
        self._last_step_s = 0.0
        self._first_sent_at_s: float | None = None  # when the first step after an idle spell left

    # -- wake-ups --------------------------------------------------------------

    def wake(self) -> None:
        """A sequence arrived, left, or the worker's state changed: plan again."""
        self._arrived = True
        for waiter in (self._due, self._woken):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def sleep(self, timeout_s: float | None) -> None:
        """Until wake(), or `timeout_s` on the injected clock (None: no limit)."""
        await self._woken_within(timeout_s)

    async def gather(self) -> None:
        """After an idle spell, before the first step: waits while sequences keep arriving, each within
        GATHER_GAP_AT of the last step time of the one before, GATHER_MAX_AT of it in all, GATHER_MAX_S
        at most (no step time known, as in a loop that has not had a result yet: not at all)."""
        step_s = self._last_step_s
        gap_s = min(GATHER_GAP_AT * step_s, GATHER_MAX_S)
        ends_s = self._clock() + min(GATHER_MAX_AT * step_s, GATHER_MAX_S)
        while (left_s := ends_s - self._clock()) > 0:
            if not await self._woken_within(min(gap_s, left_s)):
                return
        self._arrived = False

    async def _woken_within(self, timeout_s: float | None) -> bool:
        """Whether wake() came before `timeout_s` passed on the injected sleep (None: no limit). The one
        way both sleep() and gather() wait: no task with no limit, one timer task with one."""
        self._arrived = False
        woken = self._woken = asyncio.get_running_loop().create_future()
        timer = None if timeout_s is None else asyncio.create_task(self._fire_after(timeout_s, woken))
        try:
            await woken
        finally:
            self._woken = None
            if timer is not None:
                timer.cancel()
        return self._arrived

    def idle(self) -> None:
        """Nothing in flight and nothing to run: the next command's steps may be another size."""
        self._result_at_s = self._first_sent_at_s = None
        self._command_step_s = 0.0

    def sent(self, at_s: float) -> None:
        """A command left at `at_s`."""
        if self._result_at_s is None and self._first_sent_at_s is None:
            self._first_sent_at_s = at_s

    # -- commands of several steps ---------------------------------------------

    def steps_to_send(self, any_waiting: bool, num_in_flight: int, last_command_size: int) -> int:
        """How many steps to plan ahead and send in one command now, behind the `num_in_flight` steps
        (the newest sent in a command of `last_command_size`); 0: none yet, maybe with a timer armed.
        Up to steps_per_command while no sequence waits for a slot, else one (a waiting sequence is
        admitted by the next step planned, so that comes soon)."""
        if self._due is not None and self._due.done():
            self.disarm()  # it brought us here
        if self._result_at_s is None and num_in_flight == 1 and (wait_s := self._until_first_ahead_s()) > 0:
            # The step behind the first after an idle spell, whoever waits: the streams arriving together
            # land a few ms apart, and the first arrival's next step sent at once held it alone.
            self._arm(wait_s)
            return 0
        if any_waiting:
            # A newcomer's first step goes right behind a command of several steps; then one at a time.
            if num_in_flight > 1 and last_command_size == 1 or num_in_flight >= 2 * self.steps_per_command:
                return 0  # (2K: at most the worker's max_steps_in_flight)
            per_command = 1
        else:
            # After an idle spell, one step ahead until the first result: the streams that arrive
            # together land a few ms apart, and K steps sent behind the first arrival's made the rest
            # wait K + 1 steps for their prefill (5 lone steps of 38 in bench_hf_llm --quick).
            per_command = 1 if self._result_at_s is None else self.steps_per_command
            if num_in_flight > per_command:
                return 0
            if per_command > 1 and (wait_s := self._until_next_command_s(num_in_flight)) > 0:
                self._arm(wait_s)
                return 0
        self.disarm()
        return per_command

    def waits_on_more_than_results(self, last_command_size: int) -> bool:
        """Whether arrivals and the command timer also wake the loop awaiting a result: only while a
        command of several steps is in flight or the next one is timed."""
        return self._due_timer is not None or last_command_size > 1

    def arrived(self) -> bool:
        """Whether a sequence arrived since the loop last looked (and forgets it)."""
        arrived, self._arrived = self._arrived, False
        return arrived

    def due(self) -> asyncio.Future[None]:
        """Done when the next command is due or a sequence arrives."""
        return self._arm(None)

    def disarm(self) -> None:
        if self._due_timer is not None:
            self._due_timer.cancel()
        self._due = self._due_timer = None

    def _until_next_command_s(self, num_in_flight: int) -> float:
        """Seconds until the worker has one step and COMMAND_LEAD_S left of the steps in flight, by the
        per-step time of the last command of several steps (none measured yet: now)."""
        step_s = self._command_step_s
        if self._result_at_s is None or not num_in_flight or step_s <= 0:
            return 0.0
        ends_s = self._result_at_s + num_in_flight * step_s
        return ends_s - step_s - COMMAND_LEAD_S - self._clock()

    def _until_first_ahead_s(self) -> float:
        """Seconds until the step behind the first after an idle spell is due (no step time known: now)."""
        if self._first_sent_at_s is None or self._last_step_s <= 0:
            return 0.0
        return self._first_sent_at_s + FIRST_AHEAD_AT * self._last_step_s - self._clock()

    def _arm(self, wait_s: float | None) -> asyncio.Future[None]:
        """What makes the loop plan again: done in `wait_s` (None: when a sequence arrives)."""
        if self._due is None or self._due.done():
            self._due = asyncio.get_running_loop().create_future()
        if wait_s is not None and self._due_timer is None:
            self._due_timer = asyncio.create_task(self._fire_after(wait_s, self._due))
        return self._due

    async def _fire_after(self, wait_s: float, due: asyncio.Future[None]) -> None:
        await self._sleep(wait_s)
        if not due.done():
            due.set_result(None)

    # -- results ---------------------------------------------------------------

    def on_result(self, sent_at_s: float, index_in_command: int, command_size: int) -> StepTiming:
        """A step's result came back now: what it took, counted from when the worker could start it."""
        now = self._clock()
        # A step sent before the last result ran after it: its round trip starts there, with no gap.
        began_s, gap_s = sent_at_s, 0.0
        if self._result_at_s is not None:
            began_s = max(began_s, self._result_at_s)
            gap_s = max(0.0, sent_at_s - self._result_at_s)
        else:
            self.disarm()  # the step behind the first after an idle spell is planned from this result
        share_s = None
        if command_size > 1:
            # The command's results came back together: each step gets an even share of its time.
            if index_in_command == 0:
                self._command_step_s = (now - began_s) / command_size
            share_s = self._command_step_s
        self._result_at_s = now
        self._last_step_s = now - began_s if share_s is None else share_s
        return StepTiming(self._last_step_s, gap_s, share_s)
