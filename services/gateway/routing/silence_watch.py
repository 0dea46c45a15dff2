"""Noticing a scheduler that went silent while calls wait on it, within a second.

A scheduler cut off the network (or frozen) resets nothing: its connections stay up, so its
calls would wait for their deadlines, and with affinity every new call of its models joins them
until the breaker or a failed poll says otherwise, filling the model's adaptive limit on the way.
Silence alone proves nothing (a long batch sends no reply for a while), so a client that has
had calls in flight and heard nothing for `silent_s` gets a probe: a GetPressure with a
`probe_timeout_s` deadline. A live scheduler answers it from its event loop whatever its workers
are doing; one that does not answer is severed: its calls fail with UNAVAILABLE and no pushback,
so the dispatcher fails classify over and resumes streams elsewhere, and membership demotes it
until it answers a poll again.

A false positive (a scheduler stalled for longer than both times) costs duplicate work, never a
wrong answer: classify is idempotent and a resumed stream continues from the tokens delivered.
A severed call's late answer is never read: its call (or the whole Submit stream) is cancelled
when it is severed, so the call's re-dispatched attempt is the only one that can answer it.

The last scheduler answering polls is severed too when the gateway holds calls (`hold_on`,
--hold-max-calls > 0, dispatch/hold.py): its calls, and the new ones once its breaker opens, wait
in the hold, where they keep no slot of the model's adaptive limit, and go out again when a
scheduler answers a poll with the model ready. Left upstream they would wait on it as real calls,
and at 30 classify/s fill the limit within a 2 s freeze of every scheduler (issue 35). With the
hold off, nothing is probed or severed while no other scheduler answers polls: the calls would
only be re-sent to the same one (and, there being no untried endpoint, charged to the retry budget).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.gateway.routing.replicas import Membership
from services.gateway.upstream.clients import AttemptError, SchedulerClient, SchedulerClients
from services.gateway.upstream.status import UpstreamCode

log = logging.getLogger(__name__)


def may_sever(membership: Membership | None, endpoint: str, *, hold_on: bool) -> bool:
    """Whether a silent `endpoint`'s calls may be severed: there is somewhere for them to go, another
    scheduler answering polls or the hold. Membership demotes a severed endpoint, so none without it."""
    return membership is not None and (hold_on or membership.has_alternative(endpoint))


class SilenceWatch:
    def __init__(self, clients: SchedulerClients, membership: Membership | None, *, silent_s: float,
                 probe_timeout_s: float, hold_on: bool = False, check_interval_s: float = 0.1,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        """hold_on: the dispatcher holds calls no scheduler can take (--hold-max-calls > 0), so the
        last scheduler answering polls is severed too when it goes silent."""
        if not silent_s > 0 or not probe_timeout_s > 0:
            raise ValueError(f"silent_s and probe_timeout_s must be > 0, got {silent_s} and {probe_timeout_s}")
        self._clients = clients
        self._membership = membership
        self.silent_s = silent_s
        self.probe_timeout_s = probe_timeout_s
        self.hold_on = hold_on
        self.check_interval_s = check_interval_s
        self._sleep = sleep
        self._probing: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        try:
            while True:
                await self._sleep(self.check_interval_s)
                self.check()
        finally:
            for task in self._probing.values():
                task.cancel()

    def check(self) -> None:
        """Starts a probe of every client silent for silent_s with calls in flight, unless one runs."""
        for client in self._clients.clients():
            if client.address in self._probing or not self._can_fail_over(client.address):
                continue
            if client.is_silent(self.silent_s):
                self._probing[client.address] = asyncio.create_task(
                    self.probe(client), name=f"silence probe {client.address}")

    def _can_fail_over(self, endpoint: str) -> bool:
        return may_sever(self._membership, endpoint, hold_on=self.hold_on)

    async def probe(self, client: SchedulerClient) -> int:
        """Probes `client`'s scheduler; severs its calls when the probe times out. Returns calls severed."""
        try:
            await client.get_pressure(timeout_s=self.probe_timeout_s)
            return 0
        except AttemptError as exc:
            if exc.code != UpstreamCode.DEADLINE_EXCEEDED:
                return 0  # refused or reset: the calls fail by themselves, faster than a probe says
            silent_for_s = self.silent_s + self.probe_timeout_s
            why = (f"scheduler {client.address} stopped answering: nothing received for {silent_for_s:g} s "
                   f"with calls waiting, and a probe got no answer in {self.probe_timeout_s:g} s")
            if not self._can_fail_over(client.address):
                return 0
            num_calls = client.sever_if_silent(silent_for_s, why)
            if num_calls and self._membership is not None:  # _can_fail_over() needed one
                alternative = self._membership.has_alternative(client.address)
                self._membership.unreachable(client.address)
                log.warning("%s; failing its %d calls in flight over %s", why, num_calls,
                            "to other schedulers" if alternative else "to the hold (no other scheduler answers)")
            return num_calls
        finally:
            self._probing.pop(client.address, None)
