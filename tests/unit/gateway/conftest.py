"""Builders and a fake clock for the gateway's logic tests."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.priority import Priority
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
