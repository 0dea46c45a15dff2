"""The worker's probe of its schedulers: resolve the endpoints, ask each how many workers of our model
it has (GetPressure), and hand back the order to dial them in (scheduler_endpoints.dial_order)."""

from __future__ import annotations

import asyncio
import logging
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infermesh.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import tls
from services.common.scheduler_address import SchedulerAddress
from services.worker.scheduler_endpoints import EndpointLoad, dial_order, resolve

log = logging.getLogger(__name__)

# A scheduler that cannot answer GetPressure this fast is skipped this round (it is down or swamped).
PROBE_TIMEOUT_S = 0.5


async def resolve_dns(name: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]  # the address of a SOCK_STREAM sockaddr: a str


class SchedulerDialer:
    def __init__(self, endpoints: SchedulerAddress, model: common_pb2.ModelRef, worker_id: str,
                 resolver=resolve_dns, probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self._endpoints = endpoints
        self._model = model
        self._worker_id = worker_id
        self._resolver = resolver
        self._probe_timeout_s = probe_timeout_s

    @property
    def has_choice(self) -> bool:
        return not self._endpoints.is_single

    async def dial_order(self, avoid: str | None = None) -> list[str]:
        """Addresses to try, best first; empty when no scheduler answered (the caller backs off)."""
        if self._endpoints.is_single:
            return list(self._endpoints.endpoints)
        loads = await self.loads()
        order = dial_order(loads, self._worker_id, avoid)
        log.info("schedulers for %s: %s; dialling in order %s", self._model.name,
                 ", ".join(f"{load.address}={load.num_workers}" for load in loads), order)
        return order

    async def loads(self) -> list[EndpointLoad]:
        """Every endpoint now, with its workers of our model (None where it did not answer)."""
        try:
            addresses = await resolve(self._endpoints, self._resolver)
        except OSError as exc:
            log.warning("cannot resolve %s: %s", self._endpoints.dns_name, exc)
            return []
        return list(await asyncio.gather(*(self._probe(address) for address in addresses)))

    async def serving(self, address: str) -> bool:
        """Whether the scheduler at `address` says SERVING (grpc.health.v1): a draining one answers
        GetPressure with no worker of our model too, but would refuse us."""
        async with tls.aio_channel(address) as channel:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=self._probe_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.info("scheduler %s did not answer its health check: %s", address, exc.code().name)
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def _probe(self, address: str) -> EndpointLoad:
        request = scheduler_pb2.GetPressureRequest(models=[self._model])
        async with tls.aio_channel(address) as channel:
            try:
                reply = await scheduler_pb2_grpc.SchedulerStub(channel).GetPressure(
                    request, timeout=self._probe_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.info("scheduler %s did not answer: %s", address, exc.code().name)
                return EndpointLoad(address, None)
        num_workers = sum(m.num_workers for m in reply.models
                          if (m.model.name, m.model.version) == (self._model.name, self._model.version))
        return EndpointLoad(address, num_workers)
