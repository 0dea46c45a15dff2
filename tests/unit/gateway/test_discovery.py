"""Scheduler discovery: re-resolving a DNS name, what changes (parsing: tests/unit/common/test_scheduler_address.py)."""

from __future__ import annotations

import socket

from services.common.scheduler_address import parse_scheduler_address
from services.gateway.routing.discovery import SchedulerDiscovery, loop_resolver


class FakeResolver:
    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, name: str, port: int) -> list[str]:
        self.asked.append((name, port))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _discovery(resolver):
    changes = []
    discovery = SchedulerDiscovery(
        parse_scheduler_address("dns:///sched:50052"), resolver, on_change=lambda a, r: changes.append((a, r)))
    return discovery, changes


async def test_every_record_of_the_name_is_an_endpoint_and_changes_are_reported():
    resolver = FakeResolver(["10.0.0.6", "10.0.0.5"], ["10.0.0.6", "10.0.0.7"], ["10.0.0.7", "10.0.0.6"])
    discovery, changes = _discovery(resolver)
    assert discovery.endpoints == (), "nothing known before the first answer"
    await discovery.refresh()
    assert discovery.endpoints == ("10.0.0.5:50052", "10.0.0.6:50052")
    await discovery.refresh()
    assert discovery.endpoints == ("10.0.0.6:50052", "10.0.0.7:50052")
    await discovery.refresh()  # the same set in another order: no change
    assert changes == [
        (("10.0.0.5:50052", "10.0.0.6:50052"), ()),
        (("10.0.0.7:50052",), ("10.0.0.5:50052",)),
    ]
    assert resolver.asked == [("sched", 50052)] * 3


async def test_a_failed_or_empty_resolution_keeps_the_last_answer():
    resolver = FakeResolver(["10.0.0.5"], socket.gaierror(-2, "Name or service not known"), [], ["10.0.0.5"])
    discovery, changes = _discovery(resolver)
    for _ in range(4):
        await discovery.refresh()
        assert discovery.endpoints == ("10.0.0.5:50052",)
    assert len(changes) == 1


async def test_a_fixed_list_never_resolves():
    resolver = FakeResolver()
    discovery = SchedulerDiscovery(parse_scheduler_address("a:1,b:2"), resolver)
    await discovery.refresh()
    assert discovery.endpoints == ("a:1", "b:2") and resolver.asked == []


async def test_loop_resolver_returns_each_address_once_and_brackets_ipv6():
    async def getaddrinfo(name, port, type):  # noqa: A002 - getaddrinfo's own keyword
        assert (name, port, type) == ("sched", 50052, socket.SOCK_STREAM)
        return [(socket.AF_INET, type, 6, "", ("10.0.0.5", port)),
                (socket.AF_INET, type, 6, "", ("10.0.0.5", port)),
                (socket.AF_INET6, type, 6, "", ("fd00::5", port, 0, 0))]

    resolver = loop_resolver(getaddrinfo)
    assert await resolver("sched", 50052) == ["10.0.0.5", "fd00::5"]
    discovery = SchedulerDiscovery(parse_scheduler_address("dns:///sched:50052"), resolver)
    await discovery.refresh()
    assert discovery.endpoints == ("10.0.0.5:50052", "[fd00::5]:50052")


async def test_loop_resolver_resolves_localhost_for_real():
    addresses = await loop_resolver()("localhost", 50052)
    assert addresses and set(addresses) <= {"127.0.0.1", "::1"}
