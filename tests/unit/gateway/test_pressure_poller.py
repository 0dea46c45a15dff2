"""The extra poll a regrouping call starts: every call of a roll asks for one, few are made."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.gateway.routing.catalog import ModelCatalog
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.pressure_poller import EXTRA_POLL_MIN_GAP_S, PressurePoller


class CountingClient:
    def __init__(self) -> None:
        self.num_polls = 0

    async def get_pressure(self, timeout_s: float) -> scheduler_pb2.GetPressureResponse:
        self.num_polls += 1
        return scheduler_pb2.GetPressureResponse()

    async def list_models(self, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse()


async def _settle() -> None:
    for _ in range(10):  # the poll task and the gather inside it finish
        await asyncio.sleep(0)


async def test_extra_polls_run_one_at_a_time_and_at_most_one_per_gap(clock):
    client = CountingClient()
    poller = PressurePoller(
        routing=SimpleNamespace(endpoints=lambda: ("10.0.0.1:50052",)),
        clients=SimpleNamespace(get=lambda endpoint: client),
        board=PressureBoard(clock), catalog=ModelCatalog(),
        breakers=CircuitBreakers(BreakerConfig(), clock),
        interval_s=1.0, clock=clock,
    )
    for _ in range(50):  # 50 calls regrouping in the same instant
        poller.poll_soon()
    await _settle()
    assert client.num_polls == 1
    clock.advance(EXTRA_POLL_MIN_GAP_S / 2)
    poller.poll_soon()
    await _settle()
    assert client.num_polls == 1, "too soon after the last one"
    clock.advance(EXTRA_POLL_MIN_GAP_S)
    poller.poll_soon()
    await _settle()
    assert client.num_polls == 2
