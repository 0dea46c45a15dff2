"""Wiring: the public Inference service on the gateway port."""

from __future__ import annotations

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.server import Health
from services.gateway.config import GatewayConfig
from services.gateway.servicer import InferenceServicer
from services.gateway.upstream import SchedulerClient


class GatewayService:
    service_names = (gateway_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,)

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._scheduler: SchedulerClient | None = None

    def register(self, server) -> None:
        self._scheduler = SchedulerClient(self._config.scheduler_address, self._config.max_message_bytes)
        gateway_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(self._config, self._scheduler), server)

    async def start(self, health: Health) -> None:
        await health.set_serving(True)

    async def drain(self, grace_s: float) -> None:
        return None  # the server's own graceful stop lets in-flight calls finish

    async def close(self) -> None:
        if self._scheduler is not None:
            await self._scheduler.close()
