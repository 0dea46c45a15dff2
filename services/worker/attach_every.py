"""A classifier worker's Attach streams: one to every scheduler it is given, each re-dialled alone.

A batch runtime (classifiers, tensor models) holds nothing between batches, so it can serve every
scheduler at once, and it does: one AttachClient per endpoint of --scheduler-address, each with that
fixed address. A client re-dials its scheduler after a break at once when the session had lasted,
else after the short capped backoff with full jitter (--reconnect-initial-s .. --reconnect-max-s,
0.1 .. 0.5 s by default). So a scheduler that restarts has every classifier worker back within about
the backoff's cap once it listens, and it advertises the model from the first attach (it lists none
before). One stream at a time could not promise that: a worker moves to an empty scheduler only off
one with two workers of its model more (scheduler_endpoints.move_probability), so with one worker of
a model left, none moved, and a restarted scheduler served nothing for 4.5-6.1 s, until the killed
worker came back (make chaos, issue 35).

Each scheduler sees the worker's whole max_batch_size and paces itself by its own results (a batch
running, one sent ahead); the batches of all of them run on the one compute thread in the order they
arrive, and an item whose deadline passed while it waited is answered, not computed.

A DNS name (dns:///name:port) is resolved again every `resolve_interval_s`: a new record gets a
session, and the session of a record that went away is drained.

Generator workers keep one stream: a worker's KV blocks are the block tables of the one scheduler it
is attached to (attach_client.py, scheduler_dialer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from services.common.scheduler_address import SchedulerAddress
from services.worker.scheduler_endpoints import Resolver, resolve

log = logging.getLogger(__name__)

# How often a dns:/// name is resolved again for new or departed schedulers.
RESOLVE_INTERVAL_S = 1.0
# Grace for the session of a scheduler whose DNS record went away (it may still be finishing work).
RETIRED_GRACE_S = 30.0


class SessionClient(Protocol):
    """One scheduler's Attach session, re-dialled until drained (attach_client.AttachClient)."""

    async def run(self) -> None: ...

    async def drain(self, grace_s: float) -> None: ...

    def close(self) -> None: ...


# (address, the worker's compute thread) -> a client attached to that one scheduler.
ClientFactory = Callable[[str, ThreadPoolExecutor], SessionClient]


class EverySchedulerClient:
    def __init__(self, endpoints: SchedulerAddress, new_client: ClientFactory, resolver: Resolver,
                 resolve_interval_s: float = RESOLVE_INTERVAL_S) -> None:
        self._endpoints = endpoints
        self._new_client = new_client
        self._resolver = resolver
        self._resolve_interval_s = resolve_interval_s
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")
        self._clients: dict[str, SessionClient] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()

    @property
    def addresses(self) -> list[str]:
        """The schedulers this worker keeps a session with now."""
        return sorted(self._clients)

    async def run(self) -> None:
        """A session with every scheduler until drained; a DNS name's records are followed."""
        while not self._stopping.is_set():
            await self.refresh()
            if not self._endpoints.is_dns:
                break  # a fixed list never changes
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: never swallows a cancellation
                async with asyncio.timeout(self._resolve_interval_s):
                    await self._stopping.wait()
        await self._stopping.wait()

    async def refresh(self) -> None:
        """Starts a session for each new endpoint, drains those of endpoints gone."""
        try:
            addresses = await resolve(self._endpoints, self._resolver)
        except OSError as exc:
            log.warning("cannot resolve %s (keeping %d sessions): %s", self._endpoints.dns_name,
                        len(self._clients), exc)
            return
        if self._stopping.is_set():
            return
        for address in addresses:
            if address not in self._clients:
                self._start(address)
        for address in [a for a in self._clients if a not in addresses]:
            self._retire(address)

    def _start(self, address: str) -> None:
        log.info("attaching to scheduler %s too (%d sessions)", address, len(self._clients) + 1)
        client = self._clients[address] = self._new_client(address, self._compute)
        self._tasks[address] = asyncio.create_task(client.run(), name=f"attach {address}")

    def _retire(self, address: str) -> None:
        log.info("scheduler %s left the DNS records: draining its session", address)
        client, task = self._clients.pop(address), self._tasks.pop(address)

        async def drain() -> None:
            await client.drain(RETIRED_GRACE_S)
            task.cancel()
            client.close()

        retiring = asyncio.create_task(drain(), name=f"retire {address}")
        self._retiring.add(retiring)
        retiring.add_done_callback(self._retiring.discard)

    async def drain(self, grace_s: float) -> None:
        """Every session tells its scheduler, finishes what was sent, and stops re-dialling."""
        self._stopping.set()
        await asyncio.gather(*(client.drain(grace_s) for client in self._clients.values()))

    def close(self) -> None:
        for task in [*self._tasks.values(), *self._retiring]:
            task.cancel()
        for client in self._clients.values():
            client.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
