"""Builders and a fake clock for the gateway's logic tests."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from services.common.priority import Priority
from services.gateway.dispatch.deadlines import Deadline, DeadlinePolicy, Deadlines
from services.gateway.dispatch.dispatcher import Dispatcher
from services.gateway.dispatch.retry_budget import RetryBudgets
from services.gateway.dispatch.retry_policy import RetryPolicy, RetryPolicyConfig
from services.gateway.routing.circuit_breaker import CircuitBreakers
from services.gateway.routing.pressure import PressureBoard
from services.gateway.routing.replicas import Membership, ReplicaSelector
from services.gateway.routing.table import RoutingTable
from services.gateway.tenants.directory import Tenant, TenantQuota, hash_api_key
from tools.testbed.fake_clock import FakeClock  # noqa: F401 - re-exported to the tests


class FixedRng:
    """An RNG whose draws the test chooses; cycles through `values`."""

    def __init__(self, *values: float) -> None:
        self.values = values or (0.5,)
        self.num_draws = 0

    def __call__(self) -> float:
        value = self.values[self.num_draws % len(self.values)]
        self.num_draws += 1
        return value


class FakeClients:
    """The dispatcher's clients: each address is its own client."""

    def get(self, address: str) -> str:
        return address


def make_dispatcher(clock: FakeClock, breakers: CircuitBreakers, budgets: RetryBudgets,
                    endpoints: tuple[str, ...], **over) -> Dispatcher:
    """A Dispatcher over `endpoints` (all members, no routing table): three attempts, a mid-range
    jitter draw, the clock's deadlines and pressure board. `over`: sleep, max_resumes, hold..."""
    return Dispatcher(
        routing=RoutingTable((), breakers, replicas=ReplicaSelector(Membership(lambda: endpoints))),
        clients=FakeClients(),
        policy=RetryPolicy(RetryPolicyConfig(max_attempts=3), rng=FixedRng(0.5)),
        budgets=budgets,
        breakers=breakers,
        deadlines=Deadlines(DeadlinePolicy(), clock),
        board=PressureBoard(clock),
        **over,
    )


def make_scope(clock: FakeClock, model: str, timeout_s: float = 10.0) -> SimpleNamespace:
    """A call's scope as the servicer hands it to the dispatcher: standard priority, due in timeout_s."""
    return SimpleNamespace(model=model, metric_model=model, version="", priority=Priority.STANDARD,
                           deadline=Deadline(expires_at_s=clock() + timeout_s))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_quota(**over) -> TenantQuota:
    base = TenantQuota(
        requests_per_s=10, requests_burst=20, tokens_per_s=100, tokens_burst=400, max_in_flight=5
    )
    return dataclasses.replace(base, **over)


def make_tenant(tenant_id: str = "acme", **over) -> Tenant:
    base = Tenant(
        tenant_id=tenant_id,
        priority=Priority.STANDARD,
        weight=1,
        allowed_models=frozenset({"digits"}),
        quota=make_quota(),
        api_key_sha256=(hash_api_key(f"key-{tenant_id}"),),
    )
    return dataclasses.replace(base, **over)
