"""Wiring: the scheduler servicer as one service for the bootstrap."""

from __future__ import annotations

from infermesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.admin_servicer import SERVICE_NAME as ADMIN_SERVICE
from services.common.admin_servicer import AdminServicer, add_to_server
from services.common.server import Health
from services.scheduler import admin_status
from services.scheduler.config import SchedulerConfig
from services.scheduler.servicer import SchedulerServicer
from services.scheduler.step_scheduler import StepScheduler, StepSchedulerFactory


class SchedulerService:
    service_names = (scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name, ADMIN_SERVICE)

    def __init__(self, config: SchedulerConfig, step_scheduler: StepSchedulerFactory = StepScheduler) -> None:
        self._config = config
        self.servicer = SchedulerServicer(config, step_scheduler=step_scheduler)
        self.draining = False

    def register(self, server) -> None:
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(self.servicer, server)
        add_to_server(AdminServicer(*admin_status.handlers(self, self._config)), server)

    async def start(self, health: Health) -> None:
        await health.set_serving(True)

    async def drain(self, grace_s: float) -> None:
        self.draining = True
        await self.servicer.drain(grace_s)

    async def close(self) -> None:
        return None
