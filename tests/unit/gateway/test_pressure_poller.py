"""The extra poll a regrouping call starts: every call of a roll asks for one, few are made."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common import errors
from services.gateway.routing.catalog import ModelCatalog
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.pressure_poller import EXTRA_POLL_MIN_GAP_S, PressurePoller
from services.gateway.routing.recovery_watch import RECOVERY_POLL_S, RECOVERY_SETTLE_S, RECOVERY_WATCH_S
from services.gateway.routing.replicas import Membership
from services.gateway.upstream.clients import AttemptError
from services.gateway.upstream.status import UpstreamCode


class CountingClient:
    def __init__(self) -> None:
        self.num_polls = 0

    async def get_pressure(self, timeout_s: float) -> scheduler_pb2.GetPressureResponse:
        self.num_polls += 1
        return scheduler_pb2.GetPressureResponse()

    async def list_models(self, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse()


def _poller(client, clock, catalog: ModelCatalog | None = None) -> PressurePoller:
    """A poller of one endpoint, 10.0.0.1:50052, answered by `client`."""
    return PressurePoller(
        routing=SimpleNamespace(endpoints=lambda: ("10.0.0.1:50052",)),
        clients=SimpleNamespace(get=lambda endpoint: client),
        board=PressureBoard(clock), catalog=catalog or ModelCatalog(),
        breakers=CircuitBreakers(BreakerConfig(), clock),
        interval_s=1.0, clock=clock,
    )


async def _settle() -> None:
    for _ in range(10):  # the poll task and the gather inside it finish
        await asyncio.sleep(0)


async def test_extra_polls_run_one_at_a_time_and_at_most_one_per_gap(clock):
    client = CountingClient()
    poller = _poller(client, clock)
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


class ScriptedClient(CountingClient):
    """Fails while `down`, else answers with the models in `ready`."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.ready: tuple[str, ...] = ()

    async def get_pressure(self, timeout_s: float) -> scheduler_pb2.GetPressureResponse:
        if self.down:
            raise AttemptError(errors.Unavailable("connection refused"), UpstreamCode.UNAVAILABLE, None)
        return await super().get_pressure(timeout_s)

    async def list_models(self, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.ModelInfo(model=common_pb2.ModelRef(name=name, version="1"), ready=True)
            for name in self.ready])


async def test_a_scheduler_on_its_way_back_is_polled_fast_until_it_serves_its_models_again(clock):
    client = ScriptedClient()
    catalog = ModelCatalog()
    poller = _poller(client, clock, catalog)
    assert poller.recovering() == ("10.0.0.1:50052",), "watched in the gateway's first seconds"
    client.ready = ("digits", "tinylm")
    await poller.poll_once()
    clock.advance(RECOVERY_SETTLE_S)
    await poller.poll_recovering()
    assert poller.recovering() == (), "serving, settled: the whole-second schedule is enough"

    client.down = True  # killed
    await poller.poll_once()
    assert poller.recovering() == ("10.0.0.1:50052",)
    clock.advance(3 * RECOVERY_WATCH_S)
    assert poller.recovering() == ("10.0.0.1:50052",), "watched for as long as it does not answer"

    client.down, client.ready = False, ()  # restarted, no worker attached yet
    await poller.poll_recovering()
    assert poller.recovering() == ("10.0.0.1:50052",) and not catalog.knows("digits")
    client.ready = ("digits",)  # a classifier worker attached
    await poller.poll_recovering()
    assert catalog.serving("digits", "1") == frozenset({"10.0.0.1:50052"})
    clock.advance(RECOVERY_POLL_S)
    assert poller.recovering() == ("10.0.0.1:50052",), "its generator is not back yet"
    client.ready = ("digits", "tinylm")  # a generator worker attached
    await poller.poll_recovering()
    assert catalog.serving("tinylm", "1") == frozenset({"10.0.0.1:50052"})
    assert poller.recovering() == ()


async def test_a_scheduler_back_with_nothing_to_serve_is_watched_for_a_bounded_time(clock):
    client = ScriptedClient()
    poller = _poller(client, clock)
    client.down = True
    await poller.poll_once()
    client.down = False
    await poller.poll_recovering()
    clock.advance(RECOVERY_WATCH_S / 2)
    assert poller.recovering() == ("10.0.0.1:50052",)
    clock.advance(RECOVERY_WATCH_S)
    assert poller.recovering() == ()


class TimingOutClient(CountingClient):
    """A frozen scheduler with calls waiting on it: its polls time out; records what is severed."""

    def __init__(self) -> None:
        super().__init__()
        self.severed: list[float] = []

    async def get_pressure(self, timeout_s: float) -> scheduler_pb2.GetPressureResponse:
        raise AttemptError.local(UpstreamCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def sever_if_silent(self, silent_s: float, why: str) -> int:
        self.severed.append(silent_s)
        return 2


@pytest.mark.parametrize("hold_on", [False, True], ids=["hold off", "hold on"])
async def test_a_poll_timeout_severs_the_only_scheduler_only_while_the_hold_is_on(clock, hold_on):
    client = TimingOutClient()
    membership = Membership(lambda: ("10.0.0.1:50052",))
    poller = PressurePoller(
        routing=SimpleNamespace(endpoints=lambda: ("10.0.0.1:50052",)),
        clients=SimpleNamespace(get=lambda endpoint: client),
        board=PressureBoard(clock), catalog=ModelCatalog(),
        breakers=CircuitBreakers(BreakerConfig(), clock),
        interval_s=1.0, clock=clock, membership=membership, hold_on=hold_on,
    )
    await poller.poll_endpoint("10.0.0.1:50052")
    assert client.severed == ([1.0] if hold_on else []), "with the hold off its calls would only come back to it"
    assert not membership.reachable("10.0.0.1:50052")
