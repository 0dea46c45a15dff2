"""Drives a scenario against a Sender: open-loop arrivals or closed-loop clients.

Open loop: requests leave at their scheduled times whatever the server does;
the generator records how late it was itself (schedule lag) so a report can
tell a slow server from a slow load generator. With `max_in_flight` the excess
waits client-side and the wait counts in its latency. Closed loop: N clients
each send, wait for the reply, think, send again. Requests in the warm-up are
sent but marked unmeasured; requests still in flight when the drain period
ends are cancelled and recorded as CANCELLED, never dropped.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import numpy as np

from loadtest.records import CANCELLED_AT_END, OK, Outcome, RequestRecord, make_record
from loadtest.scenario import LoadMode, Scenario
from loadtest.workload import PlannedRequest, SessionTurns, WorkloadSampler, open_loop_plan


class Clock(Protocol):
    def now_s(self) -> float: ...

    async def sleep_until(self, t_s: float) -> None: ...


class MonotonicClock:
    """perf_counter rather than loop.time(): uvloop's loop clock only ticks in milliseconds."""

    def now_s(self) -> float:
        return time.perf_counter()

    async def sleep_until(self, t_s: float) -> None:
        # uvloop's timers may fire up to a millisecond early by this clock; sleep again for the rest.
        remaining_s = t_s - time.perf_counter()
        if remaining_s <= 0:
            await asyncio.sleep(0)  # always yield, so replies are processed when the schedule runs late
            return
        while remaining_s > 0:
            await asyncio.sleep(remaining_s)
            remaining_s = t_s - time.perf_counter()


class Sender(Protocol):
    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome: ...


class Phase(Enum):
    WARMUP = "warm-up"
    MEASURE = "measure"
    DRAIN = "drain"


@dataclass(frozen=True)
class ProgressSnapshot:
    elapsed_s: float
    total_s: float
    phase: Phase
    num_sent: int
    num_done: int
    num_errors: int
    num_in_flight: int
    sent_rps: float  # over the last interval
    done_rps: float
    target: float  # requests/s (open) or clients (closed) the schedule asks for now
    max_lag_ms: float  # worst generator lag in the last interval
    behind: bool  # that lag is above the scenario's lag_warn_ms


@dataclass(frozen=True)
class RunResult:
    records: tuple[RequestRecord, ...]
    lag_us: tuple[int, ...]  # generator lag of every measured open-loop send
    measured_s: float  # length of the measured period


class LoadRunner:
    def __init__(
        self,
        scenario: Scenario,
        sender: Sender,
        clock: Clock | None = None,
        on_progress: Callable[[ProgressSnapshot], None] | None = None,
        progress_interval_s: float = 1.0,
        drain_timeout_s: float | None = None,
    ) -> None:
        self._scenario = scenario
        self._sender = sender
        self._clock = clock or MonotonicClock()
        self._on_progress = on_progress
        self._progress_interval_s = progress_interval_s
        self._drain_timeout_s = drain_timeout_s if drain_timeout_s is not None else _default_drain_s(scenario)
        self._schedule = scenario.schedule()
        self._max_in_flight = scenario.load.max_in_flight
        self._slots = asyncio.Semaphore(self._max_in_flight) if self._max_in_flight else None
        self._records: list[RequestRecord] = []
        self._lag_us: list[int] = []
        self._origin_s = 0.0
        self._phase = Phase.WARMUP
        self._num_sent = 0
        self._num_errors = 0
        self._num_in_flight = 0
        self._interval_max_lag_s = 0.0
        self._stopping = False
        self._turns = SessionTurns(scenario)

    async def run(self) -> RunResult:
        self._origin_s = self._clock.now_s()
        progress = asyncio.create_task(self._report_progress()) if self._on_progress else None
        try:
            if self._scenario.load.mode is LoadMode.OPEN:
                await self._run_open_loop()
            else:
                await self._run_closed_loop()
        finally:
            if progress:
                progress.cancel()
                await asyncio.gather(progress, return_exceptions=True)
                self._emit_progress(0, 0, None)  # final line: averages over the whole run
        records = tuple(sorted(self._records, key=lambda r: r.seq))
        return RunResult(records, tuple(self._lag_us), self._scenario.duration_s)

    # -- open loop ---------------------------------------------------------

    async def _run_open_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        for planned in open_loop_plan(self._scenario):
            due_s = self._origin_s + planned.scheduled_s
            await self._clock.sleep_until(due_s)  # yields to the loop even when already due
            lag_s = max(0.0, self._clock.now_s() - due_s)
            self._interval_max_lag_s = max(self._interval_max_lag_s, lag_s)
            if planned.scheduled_s >= self._scenario.warmup_s:
                self._lag_us.append(round(lag_s * 1e6))
            task = asyncio.create_task(self._execute_session(planned) if planned.session else self._execute(planned))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await self._clock.sleep_until(self._origin_s + self._schedule.duration_s)
        await self._drain(tasks)

    # -- closed loop -------------------------------------------------------

    async def _run_closed_loop(self) -> None:
        sampler = WorkloadSampler(self._scenario, np.random.default_rng([self._scenario.seed, 2]))
        max_clients = math.ceil(max(max(s.from_value, s.to_value) for s in self._schedule.segments))
        seqs = iter(range(1 << 62))
        clients = {asyncio.create_task(self._client(i, sampler, seqs)) for i in range(max_clients)}
        await self._clock.sleep_until(self._origin_s + self._schedule.duration_s)
        await self._drain(clients)

    async def _client(self, index: int, sampler: WorkloadSampler, seqs) -> None:
        think_s = self._scenario.load.think_time_ms / 1000
        while not self._stopping:
            now_s = self._clock.now_s()
            t_s = now_s - self._origin_s
            if t_s >= self._schedule.duration_s:
                return
            if index >= round(self._schedule.value_at(t_s)):
                await self._clock.sleep_until(now_s + 0.05)  # not active at this level yet
                continue
            await self._execute(sampler.draw(next(seqs), t_s))
            if think_s:
                await self._clock.sleep_until(self._clock.now_s() + think_s)

    # -- one request -------------------------------------------------------

    async def _execute_session(self, planned: PlannedRequest | None) -> None:
        """A multi-turn session: each turn after its predecessor's reply and think time, until its
        last turn, a failed turn, or the end of the schedule (a turn not yet due then is not sent)."""
        while planned is not None:
            outcome = await self._execute(planned)
            if outcome.status != OK:
                return
            planned = self._turns.next_turn(planned, outcome.text, outcome.done_s - self._origin_s)
            if planned is None or planned.scheduled_s >= self._schedule.duration_s or self._stopping:
                return
            await self._clock.sleep_until(self._origin_s + planned.scheduled_s)

    async def _execute(self, planned: PlannedRequest) -> Outcome:
        self._num_sent += 1
        self._num_in_flight += 1
        try:
            if self._slots is not None:
                async with self._slots:
                    outcome = await self._send(planned)
            else:
                outcome = await self._send(planned)
        except asyncio.CancelledError:
            now_s = self._clock.now_s()
            outcome = Outcome(CANCELLED_AT_END, now_s, now_s, "still in flight when the drain period ended")
        except Exception as exc:  # a harness bug must show up in the report, not lose the request
            now_s = self._clock.now_s()
            outcome = Outcome("CLIENT_ERROR", now_s, now_s, f"{type(exc).__name__}: {exc}")
        finally:
            self._num_in_flight -= 1
        self._num_errors += outcome.status != OK
        c = planned.request_class
        self._records.append(make_record(
            planned.seq, c.name, c.kind, planned.tenant.name, planned.tenant.priority, planned.scheduled_s,
            outcome, self._origin_s, measured=planned.scheduled_s >= self._scenario.warmup_s))
        return outcome

    async def _send(self, planned: PlannedRequest) -> Outcome:
        deadline_ms = planned.request_class.deadline_ms
        if deadline_ms is None:
            return await self._sender.send(planned, None)
        # The deadline runs from the scheduled time: time spent queued client-side is spent.
        remaining_s = self._origin_s + planned.scheduled_s + deadline_ms / 1000 - self._clock.now_s()
        if remaining_s <= 0:
            now_s = self._clock.now_s()
            return Outcome("DEADLINE_EXCEEDED", now_s, now_s, "deadline passed while queued in the load generator")
        return await self._sender.send(planned, remaining_s)

    async def _drain(self, tasks: set[asyncio.Task]) -> None:
        self._phase = Phase.DRAIN
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=self._drain_timeout_s)
            self._stopping = True
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- progress ----------------------------------------------------------

    async def _report_progress(self) -> None:
        last_sent, last_done = 0, 0
        while True:
            await self._clock.sleep_until(self._clock.now_s() + self._progress_interval_s)
            self._emit_progress(last_sent, last_done, self._progress_interval_s)
            last_sent, last_done = self._num_sent, len(self._records)

    def _emit_progress(self, last_sent: int, last_done: int, interval_s: float | None) -> None:
        elapsed_s = self._clock.now_s() - self._origin_s
        interval_s = interval_s or max(elapsed_s, 1e-9)
        if self._phase is not Phase.DRAIN:
            self._phase = Phase.WARMUP if elapsed_s < self._scenario.warmup_s else Phase.MEASURE
        max_lag_ms = self._interval_max_lag_s * 1000
        self._interval_max_lag_s = 0.0
        assert self._on_progress is not None  # only the progress task calls this, and only when set
        self._on_progress(ProgressSnapshot(
            elapsed_s=elapsed_s,
            total_s=self._schedule.duration_s,
            phase=self._phase,
            num_sent=self._num_sent,
            num_done=len(self._records),
            num_errors=self._num_errors,
            num_in_flight=self._num_in_flight,
            sent_rps=(self._num_sent - last_sent) / interval_s,
            done_rps=(len(self._records) - last_done) / interval_s,
            target=self._schedule.value_at(min(elapsed_s, self._schedule.duration_s)),
            max_lag_ms=max_lag_ms,
            behind=max_lag_ms > self._scenario.lag_warn_ms,
        ))


def _default_drain_s(scenario: Scenario) -> float:
    """Long enough for every deadline to fire; a bounded wait when a class has none."""
    deadlines_ms = [c.deadline_ms for c in scenario.classes if c.deadline_ms is not None]
    if len(deadlines_ms) < len(scenario.classes):
        return 30.0
    return max(deadlines_ms) / 1000 + 2.0
