"""The gateway's wiring of discovery: new endpoints are routed to and polled, removed ones forgotten."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.common.config import load_config
from services.common.priority import Priority
from services.gateway.config import GatewayConfig
from services.gateway.routing.pressure import PressureReport
from services.gateway.server import GatewayService
from services.gateway.telemetry import metrics
from services.gateway.upstream.clients import SchedulerClients


class Answers:
    def __init__(self, *answers: list[str]) -> None:
        self.answers = list(answers)

    async def __call__(self, name: str, port: int) -> list[str]:
        return self.answers.pop(0)


async def test_endpoints_follow_dns_and_a_removed_one_is_forgotten():
    config = load_config(GatewayConfig, "gateway", ["--scheduler-address", "dns:///sched:50052", "--allow-anonymous"], {})
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


async def test_a_retired_endpoint_leaves_no_breaker_budget_or_metric_series():
    # Pod addresses come and go with every scheduler rollout; what the gateway keeps per endpoint must go too.
    config = load_config(GatewayConfig, "gateway", ["--scheduler-address", "dns:///sched:50052", "--allow-anonymous"], {})
    service = GatewayService(config, resolver=Answers(["10.0.0.7"]))
    gone = "10.0.0.7:50052"
    try:
        service.breakers.for_endpoint(gone)
        service.budgets.for_upstream(gone)
        metrics.observe_breakers(service.breakers.states())
        metrics.observe_budgets(service.budgets.balances())
        metrics.RETRIES.labels("tinylm", gone, "retry").inc()
        assert _series_naming(gone)
        service._retire(gone)
        assert gone not in service.breakers.states() and gone not in service.budgets.balances()
        assert _series_naming(gone) == []
    finally:
        await service.close()


def _series_naming(upstream: str) -> list[str]:
    return [sample.name for metric in REGISTRY.collect() for sample in metric.samples
            if sample.labels.get("upstream") == upstream]


async def test_a_retired_endpoints_client_is_closed_and_made_anew_on_next_use():
    clients = SchedulerClients(max_message_bytes=1 << 20)
    first = clients.get("10.0.0.1:50052")
    await clients.retire("10.0.0.1:50052")
    await clients.retire("10.0.0.9:50052")  # never used: nothing to close
    assert clients.get("10.0.0.1:50052") is not first
    await clients.close()
