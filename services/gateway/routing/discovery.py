"""Scheduler discovery: which scheduler endpoints exist right now.

`--scheduler-address` names them one of two ways (services/common/scheduler_address.py parses it):

    10.0.0.5:50052,10.0.0.6:50052     a fixed list
    dns:///schedulers.mesh.svc:50052  every A/AAAA record of the name, re-resolved
                                      every --discovery-interval-ms (a Kubernetes
                                      headless Service lists one record per ready pod)

An endpoint that disappears from DNS leaves routing at once (no new calls), while
calls already on it finish; one that appears is routed to from the next call on.
A failed resolution keeps the last answer: a DNS hiccup must not empty the mesh.

Pure logic: the resolver is injected (the event loop's getaddrinfo in production,
a fake in tests) and nothing here imports grpc.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from services.common.scheduler_address import SchedulerAddress, format_endpoint

log = logging.getLogger(__name__)

class Resolver(Protocol):
    async def __call__(self, name: str, port: int) -> list[str]:
        """Every address (IPv4 or IPv6 literal) the name has now; raises OSError when it cannot say."""


def loop_resolver(getaddrinfo: Callable[..., Awaitable[list]] | None = None) -> Resolver:
    """A Resolver over the event loop's getaddrinfo (A and AAAA records, in the order returned)."""

    async def resolve(name: str, port: int) -> list[str]:
        lookup = getaddrinfo or asyncio.get_running_loop().getaddrinfo
        infos = await lookup(name, port, type=socket.SOCK_STREAM)
        return list(dict.fromkeys(str(info[4][0]) for info in infos))  # a SOCK_STREAM sockaddr's address: a str

    return resolve


class SchedulerDiscovery:
    """The live endpoint set; `refresh()` re-resolves a DNS target and reports what changed.

    on_change(added, removed) runs after each refresh that changed the set, so the
    gateway can poll new endpoints and forget the pressure of removed ones.
    """

    def __init__(self, target: SchedulerAddress, resolver: Resolver | None = None,
                 on_change: Callable[[tuple[str, ...], tuple[str, ...]], None] | None = None) -> None:
        self.target = target
        self._resolver = resolver or loop_resolver()
        self._on_change = on_change
        self._endpoints: tuple[str, ...] = target.endpoints
        self._failing = False

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints new calls may go to (for a DNS target: the last successful answer)."""
        return self._endpoints

    async def refresh(self) -> None:
        if not self.target.is_dns:
            return
        try:
            addresses = await self._resolver(self.target.dns_name, self.target.port)
        except OSError as exc:
            if not self._failing:  # once per outage
                log.warning("resolving %s failed, keeping %d known schedulers: %s",
                            self.target.dns_name, len(self._endpoints), exc)
            self._failing = True
            return
        if self._failing:
            log.info("resolving %s works again", self.target.dns_name)
            self._failing = False
        if not addresses:  # an empty answer during a rollout is no reason to route nowhere
            return
        self._replace(format_endpoint(a, self.target.port) for a in addresses)

    async def run(self, interval_s: float, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        while True:
            await self.refresh()
            await sleep(interval_s)

    def _replace(self, endpoints: Iterable[str]) -> None:
        new = tuple(sorted(set(endpoints)))
        old = self._endpoints
        if new == old:
            return
        added = tuple(e for e in new if e not in old)
        removed = tuple(e for e in old if e not in new)
        self._endpoints = new
        log.info("schedulers behind %s: %s (added %s, removed %s)",
                 self.target.dns_name, ", ".join(new), list(added), list(removed))
        if self._on_change is not None:
            self._on_change(added, removed)
