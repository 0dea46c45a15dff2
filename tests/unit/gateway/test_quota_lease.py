"""SharedQuotas: admission from leased slices, fallback division, re-sync (fake clock, no store)."""

from __future__ import annotations

import pytest

from services.gateway.quota.lease import LeaseConfig, LeaseMode, LeaseReply, SharedQuotas, TenantGrant
from services.gateway.quota.quotas import QuotaExceeded

from .conftest import make_quota, make_tenant


def _quotas(clock, **config) -> SharedQuotas:
    return SharedQuotas(clock, LeaseConfig(**{"interval_s": 0.1, **config}))


def _reply(tenant_id="acme", requests=0.0, tokens=0.0, slots=0, live=3) -> LeaseReply:
    return LeaseReply(num_live_gateways=live, grants=(TenantGrant(tenant_id, requests, tokens, slots),))


def _admit_all(quotas, tenant, num_tokens=0) -> int:
    admitted = 0
    while True:
        try:
            quotas.admit(tenant, num_tokens).release()
        except QuotaExceeded:
            return admitted
        admitted += 1


def test_before_any_store_answer_each_gateway_enforces_quota_over_expected_gateways(clock):
    quotas = _quotas(clock, expected_gateways=4)
    tenant = make_tenant(quota=make_quota(requests_per_s=40, requests_burst=20, max_in_flight=8))
    quotas.update([tenant])
    assert quotas.mode is LeaseMode.FALLBACK
    assert _admit_all(quotas, tenant) == 5  # burst 20 / 4
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit(tenant)
    assert info.value.kind == "requests_per_s"
    assert info.value.retry_after_s == pytest.approx(0.1)  # one request at 40 / 4 per s
    clock.advance(1.0)
    assert _admit_all(quotas, tenant) == 5  # refilled 10, capped at the 5 burst share


def test_fallback_in_flight_share_is_at_least_one(clock):
    quotas = _quotas(clock, expected_gateways=3)
    tenant = make_tenant(quota=make_quota(max_in_flight=7))
    quotas.update([tenant])
    leases = [quotas.admit(tenant), quotas.admit(tenant)]  # 7 // 3
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit(tenant)
    assert info.value.kind == "max_in_flight"
    assert "limit 7 across all gateways" in info.value.message
    leases[0].release()
    quotas.admit(tenant)
    tiny = make_tenant("tiny", quota=make_quota(max_in_flight=1))
    quotas.update([tenant, tiny])
    quotas.admit(tiny)  # 1 // 3 would lock it out everywhere


def test_leased_mode_admits_exactly_the_grant_and_hints_the_next_lease(clock):
    quotas = _quotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=1000, requests_burst=1000, max_in_flight=50))
    quotas.update([tenant])
    quotas.plan()
    assert quotas.apply(_reply(requests=7, tokens=0, slots=50)) is True  # leaves the start-up fallback
    assert quotas.mode is LeaseMode.LEASED
    clock.advance(5.0)  # a slice does not refill by itself
    assert _admit_all(quotas, tenant) == 7
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit(tenant)
    assert info.value.retry_after_s == pytest.approx(0.1)
    assert "across all gateways" in info.value.message


def test_each_plan_returns_the_unused_slice_and_spending_during_the_round_trip_is_settled(clock):
    quotas = _quotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=100, requests_burst=100, max_in_flight=50))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=10, slots=50))
    for _ in range(4):
        quotas.admit(tenant).release()
    ask = quotas.plan().asks[0]
    assert ask.return_requests == pytest.approx(6)
    quotas.admit(tenant).release()  # spent while the sync is on the wire: from the slice being returned
    quotas.apply(_reply(requests=8, slots=50))
    assert _admit_all(quotas, tenant) == 7  # the new grant less the one spent since the plan


def test_leaving_fallback_drops_the_local_bucket_but_owes_what_it_spent(clock):
    quotas = _quotas(clock, expected_gateways=2)
    tenant = make_tenant(quota=make_quota(requests_per_s=10, requests_burst=20, max_in_flight=50))
    quotas.update([tenant])
    ask = quotas.plan().asks[0]
    assert ask.return_requests == 0  # fallback tokens never came from the store
    quotas.admit(tenant).release()
    quotas.admit(tenant).release()
    quotas.apply(_reply(requests=5, slots=50))
    assert _admit_all(quotas, tenant) == 3


def test_store_loss_falls_back_to_quota_over_live_gateways_last_reported(clock):
    quotas = _quotas(clock, expected_gateways=1)
    tenant = make_tenant(quota=make_quota(requests_per_s=30, requests_burst=30, max_in_flight=9))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=25, slots=9, live=3))
    assert quotas.store_unreachable() is True
    assert quotas.store_unreachable() is False  # one transition, however many failed syncs
    assert quotas.num_live_gateways == 3
    assert _admit_all(quotas, tenant) == 10  # the 25 slice capped at burst 30 / 3
    clock.advance(1.0)
    assert _admit_all(quotas, tenant) == 10  # 30 / 3 per s


def test_fallback_in_flight_limit_follows_live_gateways(clock):
    quotas = _quotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=1000, requests_burst=1000, max_in_flight=9))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=100, slots=9, live=3))
    quotas.store_unreachable()
    leases = [quotas.admit(tenant) for _ in range(3)]
    with pytest.raises(QuotaExceeded):
        quotas.admit(tenant)
    for lease in leases:
        lease.release()


def test_re_sync_after_fallback_takes_the_store_grant(clock):
    quotas = _quotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=10, requests_burst=10, max_in_flight=9))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=4, slots=9, live=2))
    quotas.store_unreachable()
    clock.advance(10.0)  # the fallback bucket fills to 10 / 2
    quotas.plan()
    assert quotas.apply(_reply(requests=2, slots=9, live=2)) is True
    assert _admit_all(quotas, tenant) == 2


def test_slice_wanted_follows_recent_demand_within_burst(clock):
    quotas = _quotas(clock, headroom=2.0, demand_smoothing=1.0)
    tenant = make_tenant(quota=make_quota(requests_per_s=50, requests_burst=40, max_in_flight=50))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=0, slots=50))
    clock.advance(0.1)
    for _ in range(15):  # 150 requests/s offered, all refused: demand counts what was asked for
        with pytest.raises(QuotaExceeded):
            quotas.admit(tenant)
    ask = quotas.plan().asks[0]
    assert ask.want_requests == pytest.approx(30)  # 150/s x 0.1 s x headroom 2
    clock.advance(0.1)
    for _ in range(100):
        with pytest.raises(QuotaExceeded):
            quotas.admit(tenant)
    assert quotas.plan().asks[0].want_requests == 40  # capped at the burst
    clock.advance(0.1)
    idle = quotas.plan().asks[0]
    assert idle.want_requests == 0  # idle: no demand, only headroom (its share of the burst)
    assert idle.floor_requests == pytest.approx(40 / 3)  # burst 40 over the 3 live gateways


def test_token_slice_covers_the_largest_recent_charge_and_refunds_return_to_the_store(clock):
    quotas = _quotas(clock, demand_smoothing=1.0)
    tenant = make_tenant(quota=make_quota(tokens_per_s=100, tokens_burst=400, max_in_flight=50))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=5, tokens=100, slots=50))
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit(tenant, num_tokens=300)
    assert info.value.kind == "tokens_per_s"
    clock.advance(0.1)
    assert quotas.plan().asks[0].want_tokens >= 300
    quotas.apply(_reply(requests=5, tokens=300, slots=50))
    lease = quotas.admit(tenant, num_tokens=300)
    assert lease.release(num_tokens_used=120) == 180
    assert quotas.plan().asks[0].return_tokens == pytest.approx(180)
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit(tenant, num_tokens=401)
    assert info.value.kind == "tokens_burst"
    assert info.value.retry_after_s is None


def test_usage_past_the_charge_is_spent_from_the_slice_and_settled_as_any_spend(clock):
    quotas = _quotas(clock, demand_smoothing=1.0)
    tenant = make_tenant(quota=make_quota(tokens_per_s=100, tokens_burst=400, max_in_flight=50))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=5, tokens=300, slots=50))
    lease = quotas.admit(tenant, num_tokens=200)
    assert lease.release(num_tokens_used=260) == 0
    assert quotas.plan().asks[0].return_tokens == pytest.approx(300 - 260)


def test_in_flight_limit_is_the_granted_slots_and_the_ask_covers_what_runs(clock):
    quotas = _quotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=1000, requests_burst=1000, max_in_flight=10))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(_reply(requests=100, slots=2))
    first, second = quotas.admit(tenant), quotas.admit(tenant)
    with pytest.raises(QuotaExceeded) as info:
        quotas.admit(tenant)
    assert info.value.message == (
        "tenant 'acme' has 2 requests in flight here and may have 2 at this gateway now "
        "(limit 10 across all gateways)"
    )
    ask = quotas.plan().asks[0]
    assert ask.num_in_flight == 2
    assert 3 <= ask.want_in_flight <= 10
    first.release()
    first.release()  # a second release does nothing
    second.release()
    assert quotas.num_in_flight("acme") == 0


def test_a_grant_missing_from_the_reply_leases_nothing(clock):
    quotas = _quotas(clock)
    tenant = make_tenant(quota=make_quota(max_in_flight=5))
    quotas.update([tenant])
    quotas.plan()
    quotas.apply(LeaseReply(num_live_gateways=1, grants=()))
    with pytest.raises(QuotaExceeded):
        quotas.admit(tenant)


def test_removed_tenants_are_forgotten_and_reloads_keep_slices(clock):
    quotas = _quotas(clock)
    acme, other = make_tenant(), make_tenant("other")
    quotas.update([acme, other])
    assert quotas.tenant_ids() == {"acme", "other"}
    quotas.plan()
    quotas.apply(LeaseReply(num_live_gateways=1, grants=(TenantGrant("acme", 3, 0, 5), TenantGrant("other", 1, 0, 5))))
    quotas.update([acme])
    assert quotas.tenant_ids() == {"acme"}
    assert _admit_all(quotas, acme) == 3


def test_config_is_checked():
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        LeaseConfig(interval_s=0)
    with pytest.raises(ValueError, match="expected_gateways must be >= 1"):
        LeaseConfig(expected_gateways=0)
