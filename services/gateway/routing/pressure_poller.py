"""Background feedback from the schedulers: pressure for shedding, model catalog for KServe.

About once a second the gateway asks every scheduler endpoint in its routing
table (the discovered ones included) for `GetPressure` (fed to the
`PressureBoard`: queue-time estimates, KV usage, minimum service time) and
`ListModels` (kept in `ModelCatalog`: kind, labels and input size of each
attached model version; and in `Membership`: which models it serves ready). An
endpoint that does not answer keeps its last reports until they go stale on the
board (fail open), and membership tries it after the others.

An endpoint on its way back (new to the gateway, or its poll failed) is polled every
RECOVERY_POLL_S instead, until it serves again every model it served before, for up to
RECOVERY_WATCH_S after it answers again (routing/recovery_watch.py). A restarted scheduler
lists a model only once a worker of it attached, so each of its models takes traffic within
~0.1 s of its first worker, not after the next whole-second poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services.common.clock import Clock
from services.common.log_context import clean_context
from services.gateway.routing.catalog import ModelCatalog
from services.gateway.routing.circuit_breaker import CircuitBreakers
from services.gateway.routing.pressure import PressureBoard, PressureReport
from services.gateway.routing.recovery_watch import RECOVERY_POLL_S, RecoveryWatch
from services.gateway.routing.replicas import Membership
from services.gateway.routing.silence_watch import may_sever
from services.gateway.routing.table import RoutingTable
from services.gateway.telemetry import metrics
from services.gateway.upstream.clients import AttemptError, SchedulerClients
from services.gateway.upstream.status import UpstreamCode

log = logging.getLogger(__name__)
EXTRA_POLL_MIN_GAP_S = 0.1


class PressurePoller:
    def __init__(
        self,
        *,
        routing: RoutingTable,
        clients: SchedulerClients,
        board: PressureBoard,
        catalog: ModelCatalog,
        breakers: CircuitBreakers,
        interval_s: float,
        membership: Membership | None = None,
        clock: Clock = time.monotonic,
        after_poll: Callable[[], None] = lambda: None,
        on_answer: Callable[[str, list[str]], None] = lambda endpoint, ready_models: None,
        hold_on: bool = False,
    ) -> None:
        """after_poll: runs after each round of polls (the server publishes the retry budgets' gauges
        then, on the same beat as the breakers'). on_answer: runs with an endpoint that answered a
        poll and the models it reported ready, once what it said is applied (the server wakes the
        calls of those models held for want of a scheduler). hold_on: calls no scheduler can take are
        held (--hold-max-calls > 0), so a silent scheduler is severed even when it is the last one
        answering (silence_watch.may_sever)."""
        self._routing = routing
        self._clients = clients
        self._board = board
        self._catalog = catalog
        self._breakers = breakers
        self._after_poll = after_poll
        self._on_answer = on_answer
        self.interval_s = interval_s
        self._membership = membership
        self._hold_on = hold_on
        # Endpoints that answered the last poll (KServe ServerReady).
        self.reachable: set[str] = set()
        self._failing: set[str] = set()
        self._extra_poll: asyncio.Task | None = None
        self._extra_poll_at_s = float("-inf")
        self._clock = clock
        self._recovery = RecoveryWatch(clock)

    async def run(self) -> None:
        await asyncio.gather(self._run_schedule(), self._run_recovery())

    async def _run_schedule(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def _run_recovery(self) -> None:
        while True:
            await asyncio.sleep(RECOVERY_POLL_S)
            await self.poll_recovering()

    def recovering(self) -> tuple[str, ...]:
        """The endpoints polled every RECOVERY_POLL_S now (see the module's docstring)."""
        return self._recovery.watched(self._routing.endpoints())

    async def poll_recovering(self) -> None:
        if endpoints := self.recovering():
            await asyncio.gather(*(self.poll_endpoint(e) for e in endpoints))

    def poll_soon(self) -> None:
        """Polls every endpoint now, outside the schedule: a call regrouping after a restart needs to
        know within its round that the restarted scheduler answers again, which lets its breaker probe
        and membership take it back. Every call of a roll regroups, so such polls start at most one at
        a time and one per EXTRA_POLL_MIN_GAP_S (the first regroup round's wait)."""
        now_s = self._clock()
        if now_s - self._extra_poll_at_s < EXTRA_POLL_MIN_GAP_S:
            return
        if self._extra_poll is None or self._extra_poll.done():
            self._extra_poll_at_s = now_s
            self._extra_poll = asyncio.create_task(self.poll_once(), name="pressure-poll-now", context=clean_context())

    async def poll_once(self) -> None:
        await asyncio.gather(*(self.poll_endpoint(e) for e in self._routing.endpoints()))
        metrics.observe_breakers(self._breakers.states())
        self._after_poll()

    async def poll_endpoint(self, endpoint: str) -> None:
        client = self._clients.get(endpoint)
        try:
            pressure = await client.get_pressure(timeout_s=self.interval_s)
            models = await client.list_models(timeout_s=self.interval_s)
        except AttemptError as exc:
            self._recovery.failed(endpoint)
            self.reachable.discard(endpoint)
            if self._membership is not None:
                self._membership.unreachable(endpoint)
            if exc.code == UpstreamCode.DEADLINE_EXCEEDED:
                self._sever_if_silent(endpoint, client)
            if endpoint not in self._failing:  # once per outage, not every second
                log.warning("scheduler %s: pressure poll failed: %s", endpoint, exc.error.message)
                self._failing.add(endpoint)
            return
        if endpoint in self._failing:
            log.info("scheduler %s answers pressure polls again", endpoint)
            self._failing.discard(endpoint)
        self.reachable.add(endpoint)
        ready_models = [m.model.name for m in models.models if m.ready]
        self._recovery.answered(endpoint, ready_models)
        self._breakers.for_endpoint(endpoint).answered_poll()
        self._board.update(endpoint, [_report(p) for p in pressure.models])
        self._catalog.update(endpoint, tuple(models.models))
        if self._membership is not None:
            self._membership.update(endpoint, ready_models)
        self._on_answer(endpoint, ready_models)


    def _sever_if_silent(self, endpoint: str, client) -> None:
        # A poll that got no answer in time, from a scheduler that also sent nothing to the calls
        # waiting on it for as long: it is cut off or frozen, not slow. Its calls fail over now,
        # when there is another scheduler or the hold to take them (silence_watch.py does this sooner).
        if not may_sever(self._membership, endpoint, hold_on=self._hold_on):
            return
        why = (f"scheduler {endpoint} stopped answering: nothing received for {self.interval_s:g} s "
               f"and a pressure poll timed out")
        num_calls = client.sever_if_silent(self.interval_s, why)
        if num_calls:
            log.warning("%s; failing its %d calls in flight over to other schedulers", why, num_calls)


def _report(pressure) -> PressureReport:
    return PressureReport.from_fields(
        pressure.model.name,
        list(pressure.est_queue_time_us),
        pressure.queue_depth,
        pressure.kv_usage,
        pressure.num_workers,
        pressure.min_service_time_us,
        pressure.num_slots,
        list(pressure.predicted_ttft_us),
        pressure.min_ttft_us,
        list(pressure.ttft_per_queued_us),
        pressure.ttft_per_prompt_token_ns,
    )
