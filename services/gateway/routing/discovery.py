"""Scheduler discovery: which scheduler endpoints exist right now.

`--scheduler-address` names them one of two ways:

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
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

DNS_SCHEME = "dns:///"


class DiscoveryConfigError(ValueError):
    """The scheduler address is unusable; the message quotes it and says what form is expected."""


@dataclass(frozen=True)
class SchedulerTarget:
    """What --scheduler-address names: a fixed endpoint list, or a DNS name and port."""

    # host:port endpoints of a fixed list; empty for a DNS target.
    endpoints: tuple[str, ...] = ()
    # The DNS name whose records are the endpoints; "" for a fixed list.
    dns_name: str = ""
    port: int = 0

    @property
    def is_dns(self) -> bool:
        return bool(self.dns_name)


def parse_scheduler_target(text: str) -> SchedulerTarget:
    """Parses `host:port[,host:port...]` or `dns:///name:port`; raises DiscoveryConfigError."""
    text = text.strip()
    if text.startswith(DNS_SCHEME):
        host, port = _split_host_port(text[len(DNS_SCHEME):], text)
        return SchedulerTarget(dns_name=host, port=port)
    if "://" in text:
        raise DiscoveryConfigError(
            f"scheduler address {text!r}: unknown scheme (expected host:port[,host:port...] or dns:///name:port)")
    endpoints = []
    for item in text.split(","):
        host, port = _split_host_port(item.strip(), text)
        endpoints.append(format_endpoint(host, port))
    if len(set(endpoints)) != len(endpoints):
        raise DiscoveryConfigError(f"scheduler address {text!r}: lists an endpoint twice")
    return SchedulerTarget(endpoints=tuple(endpoints))


def _split_host_port(item: str, whole: str) -> tuple[str, int]:
    host, sep, port_text = item.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:50052
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise DiscoveryConfigError(
            f"scheduler address {whole!r}: {item!r} is not host:port with a port in 1..65535 "
            f"(expected host:port[,host:port...] or dns:///name:port)")
    return host, int(port_text)


def format_endpoint(host: str, port: int) -> str:
    """host:port as gRPC dials it: IPv6 literals in brackets."""
    try:
        is_v6 = ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


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

    def __init__(self, target: SchedulerTarget, resolver: Resolver | None = None,
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
