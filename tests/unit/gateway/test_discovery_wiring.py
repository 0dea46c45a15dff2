"""The gateway's wiring of discovery: new endpoints are routed to and polled, removed ones forgotten."""

from __future__ import annotations

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.gateway.server import GatewayService
from services.gateway.shedding import PressureReport
from services.gateway.tenants import Priority
from services.gateway.upstream import SchedulerClients


class Answers:
    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)

    async def __call__(self, name: str, port: int) -> list[str]:
        return self.answers.pop(0)


async def test_endpoints_follow_dns_and_a_removed_one_is_forgotten():
    config = load_config(GatewayConfig, "gateway", ["--scheduler-address", "dns:///sched:50052"], {})
    service = GatewayService(config, resolver=Answers(["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"]))
    try:
        assert service.routing.endpoints() == ()
        await service.discovery.refresh()
        assert service.routing.endpoints() == ("10.0.0.1:50052", "10.0.0.2:50052")
        service.board.update("10.0.0.1:50052", [PressureReport("tinylm", {p: 0.0 for p in Priority})])
        service.membership.update("10.0.0.1:50052", ["tinylm"])
        assert service.routing.choose("tinylm").endpoint == "10.0.0.1:50052"

        await service.discovery.refresh()
        assert service.routing.endpoints() == ("10.0.0.2:50052", "10.0.0.3:50052")
        assert service.board.report("10.0.0.1:50052", "tinylm") is None, "its pressure no longer counts"
        assert service.routing.choose("tinylm").endpoint in ("10.0.0.2:50052", "10.0.0.3:50052")
    finally:
        await service.close()


async def test_a_retired_endpoints_client_is_closed_and_made_anew_on_next_use():
    clients = SchedulerClients(max_message_bytes=1 << 20)
    first = clients.get("10.0.0.1:50052")
    await clients.retire("10.0.0.1:50052")
    await clients.retire("10.0.0.9:50052")  # never used: nothing to close
    assert clients.get("10.0.0.1:50052") is not first
    await clients.close()
