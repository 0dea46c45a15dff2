"""A classifier worker keeps a session with every scheduler (services/worker/attach_every.py): one per
endpoint of a fixed list, following a DNS name's records, all on one compute thread, all drained; a
scheduler that stays down is re-dialled quietly."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services.common.scheduler_address import parse_scheduler_address
from services.worker.attach_client import AttachClient
from services.worker.attach_every import EverySchedulerClient


class FakeSession:
    def __init__(self, address, compute):
        self.address = address
        self.compute = compute
        self.running = False
        self.drained_with: float | None = None
        self.closed = False
        self._done = asyncio.Event()

    async def run(self):
        self.running = True
        await self._done.wait()

    async def drain(self, grace_s):
        self.drained_with = grace_s
        self._done.set()

    def close(self):
        self.closed = True


class Sessions:
    def __init__(self):
        self.made: list[FakeSession] = []

    def __call__(self, address, compute):
        session = FakeSession(address, compute)
        self.made.append(session)
        return session

    def by_address(self):
        return {s.address: s for s in self.made}


async def no_dns(name, port):
    raise AssertionError("a fixed list is never resolved")


async def test_a_fixed_list_gets_one_session_per_scheduler_on_one_compute_thread_and_drains_them_all():
    sessions = Sessions()
    client = EverySchedulerClient(parse_scheduler_address("a:1,b:2,c:3"), sessions, no_dns)
    running = asyncio.create_task(client.run())
    await asyncio.sleep(0)  # the sessions start
    await asyncio.sleep(0)
    assert client.addresses == ["a:1", "b:2", "c:3"]
    assert all(s.running for s in sessions.made)
    assert len({id(s.compute) for s in sessions.made}) == 1, "batches of every scheduler share the compute thread"
    await client.drain(4.0)
    await asyncio.wait_for(running, timeout=1.0)
    assert [s.drained_with for s in sessions.made] == [4.0, 4.0, 4.0]
    client.close()
    assert all(s.closed for s in sessions.made)


async def test_a_dns_name_gains_a_session_per_new_record_and_drains_the_session_of_a_record_gone():
    records = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"]]

    async def resolver(name, port):
        assert (name, port) == ("schedulers", 7000)
        return records.pop(0)

    sessions = Sessions()
    client = EverySchedulerClient(parse_scheduler_address("dns:///schedulers:7000"), sessions, resolver)
    await client.refresh()
    assert client.addresses == ["10.0.0.1:7000", "10.0.0.2:7000"]
    await client.refresh()
    assert client.addresses == ["10.0.0.2:7000", "10.0.0.3:7000"]
    await asyncio.sleep(0)  # the departed record's session drains
    gone = sessions.by_address()["10.0.0.1:7000"]
    assert gone.drained_with is not None and gone.closed
    assert len(sessions.made) == 3, "the record that stayed kept its session"
    client.close()


async def test_a_failed_resolution_keeps_the_sessions_it_has():
    answers: list[list[str] | OSError] = [["10.0.0.1"], OSError("no DNS")]

    async def resolver(name, port):
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    sessions = Sessions()
    client = EverySchedulerClient(parse_scheduler_address("dns:///schedulers:7000"), sessions, resolver)
    await client.refresh()
    await client.refresh()
    assert client.addresses == ["10.0.0.1:7000"]
    assert sessions.made[0].drained_with is None
    client.close()


async def test_a_dns_name_is_followed_until_the_worker_drains():
    resolved = asyncio.Event()
    records = ["10.0.0.1"]

    async def resolver(name, port):
        resolved.set()
        return list(records)

    sessions = Sessions()
    client = EverySchedulerClient(parse_scheduler_address("dns:///schedulers:7000"), sessions, resolver,
                                  resolve_interval_s=0.001)
    running = asyncio.create_task(client.run())
    await resolved.wait()
    records.append("10.0.0.2")
    while len(client.addresses) < 2:
        await asyncio.sleep(0.001)
    await client.drain(1.0)
    await asyncio.wait_for(running, timeout=1.0)
    assert all(s.drained_with == 1.0 for s in sessions.made)
    client.close()


class ZeroBackoff:
    def next_delay_s(self):
        return 0.0

    def reset(self):
        pass


class DownScheduler(AttachClient):
    """A client whose scheduler refuses every dial (connection refused), `num_dials` times."""

    def __init__(self, num_dials):
        super().__init__("a:1", runtime=None, worker_id="w", backoff=ZeroBackoff())
        self.num_dials = num_dials

    async def _session(self):
        self.num_dials -= 1
        if self.num_dials <= 0:
            self._stopping = True
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "failed to connect to all addresses")


async def test_a_scheduler_that_stays_down_is_re_dialled_without_a_warning_each_time(caplog):
    """Every stream re-dials its scheduler every <= 0.5 s while it is down: the first failures warn,
    the rest are DEBUG, so a dead endpoint in the list does not flood the log."""
    client = DownScheduler(num_dials=50)
    with caplog.at_level(logging.DEBUG, logger="services.worker.attach_client"):
        await client.run()
    client.close()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 3
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) >= 90
