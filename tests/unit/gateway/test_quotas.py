from __future__ import annotations

import pytest

from services.common.errors import ResourceExhausted
from services.gateway.quota.quotas import TenantQuotas, TokenBucket

from .conftest import make_quota, make_tenant


def test_bucket_starts_full_and_refills_at_rate():
    bucket = TokenBucket(rate_per_s=2.0, burst=4, now_s=0.0)
    bucket.take(4, now_s=0.0)
    assert bucket.level(0.0) == 0
    assert bucket.level(1.0) == pytest.approx(2.0)
    assert bucket.level(100.0) == 4  # capped at burst


def test_bucket_wait_is_missing_tokens_over_rate():
    bucket = TokenBucket(rate_per_s=4.0, burst=10, now_s=0.0)
    bucket.take(10, now_s=0.0)
    assert bucket.wait_s(1, now_s=0.0) == pytest.approx(0.25)
    assert bucket.wait_s(6, now_s=0.5) == pytest.approx(1.0)  # 2 refilled, 4 missing at 4/s
    assert bucket.wait_s(2, now_s=0.5) == 0.0


def test_admits_burst_then_rejects_with_retry_after_from_refill(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=10, requests_burst=3, max_in_flight=100))
    for _ in range(3):
        quotas.admit(tenant).release()
    with pytest.raises(ResourceExhausted) as info:
        quotas.admit(tenant)
    assert info.value.retry_after_s == pytest.approx(0.1)
    assert info.value.message == (
        "tenant 'acme' is over its request rate quota (10 requests/s, burst 3); retry after 0.100 s"
    )
    clock.advance(0.04)
    with pytest.raises(ResourceExhausted) as info:
        quotas.admit(tenant)
    assert info.value.retry_after_s == pytest.approx(0.06)
    clock.advance(0.06)
    quotas.admit(tenant)


def test_rejected_requests_take_nothing_from_the_bucket(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(requests_per_s=1, requests_burst=1))
    quotas.admit(tenant).release()
    for _ in range(50):
        with pytest.raises(ResourceExhausted):
            quotas.admit(tenant)
    clock.advance(1.0)
    quotas.admit(tenant)


def test_generate_is_charged_up_front_and_refunded_unused_tokens(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(tokens_per_s=100, tokens_burst=400))
    lease = quotas.admit(tenant, num_tokens=300)  # prompt 44 + max_tokens 256
    assert quotas.tokens_available("acme") == pytest.approx(100)

    refund = lease.release(num_tokens_used=44 + 20)  # stopped at EOS after 20 tokens

    assert refund == 236
    assert quotas.tokens_available("acme") == pytest.approx(336)
    assert lease.release(num_tokens_used=0) == 0  # second release is a no-op
    assert quotas.tokens_available("acme") == pytest.approx(336)


def test_usage_past_an_estimated_charge_is_taken_so_the_charge_is_exact(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(tokens_per_s=100, tokens_burst=400))
    lease = quotas.admit(tenant, num_tokens=300)  # a chat's estimate
    assert lease.release(num_tokens_used=390) == 0  # its template added more than the estimate allowed
    assert quotas.tokens_available("acme") == pytest.approx(10)
    lease = quotas.admit(tenant, num_tokens=0)
    lease.release(num_tokens_used=30)  # below zero: the next request waits for the refill
    assert quotas.tokens_available("acme") == pytest.approx(-20)
    with pytest.raises(ResourceExhausted):
        quotas.admit(tenant, num_tokens=1)


def test_refund_never_exceeds_burst(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(tokens_per_s=100, tokens_burst=400))
    lease = quotas.admit(tenant, num_tokens=300)
    clock.advance(10.0)  # bucket refilled meanwhile
    lease.release(num_tokens_used=0)
    assert quotas.tokens_available("acme") == 400


def test_token_quota_rejects_with_time_to_refill_the_missing_tokens(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(tokens_per_s=100, tokens_burst=400))
    quotas.admit(tenant, num_tokens=350)
    with pytest.raises(ResourceExhausted) as info:
        quotas.admit(tenant, num_tokens=150)
    assert info.value.retry_after_s == pytest.approx(1.0)  # 50 available, 100 missing at 100/s
    assert info.value.message == (
        "tenant 'acme' is over its token rate quota (100 tokens/s, burst 400): request needs 150 tokens; "
        "retry after 1.000 s"
    )
    assert quotas.num_in_flight("acme") == 1  # the rejected one holds nothing


def test_request_larger_than_token_burst_is_refused_without_retry_hint(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant(quota=make_quota(tokens_burst=400))
    with pytest.raises(ResourceExhausted) as info:
        quotas.admit(tenant, num_tokens=401)
    assert info.value.retry_after_s is None
    assert info.value.message == (
        "request needs 401 tokens (prompt + max_tokens) but tenant 'acme' may use at most 400 at once; "
        "lower max_tokens"
    )


def test_in_flight_cap_rejects_until_a_request_ends(clock):
    quotas = TenantQuotas(clock, in_flight_retry_after_s=0.2)
    tenant = make_tenant(quota=make_quota(max_in_flight=2))
    first = quotas.admit(tenant)
    quotas.admit(tenant)
    with pytest.raises(ResourceExhausted) as info:
        quotas.admit(tenant)
    assert info.value.message == "tenant 'acme' has 2 requests in flight (limit 2)"
    assert info.value.retry_after_s == 0.2
    first.release()
    first.release()
    assert quotas.num_in_flight("acme") == 1
    quotas.admit(tenant)


def test_tenants_have_separate_buckets(clock):
    quotas = TenantQuotas(clock)
    quota = make_quota(requests_per_s=1, requests_burst=1)
    quotas.admit(make_tenant("a", quota=quota))
    quotas.admit(make_tenant("b", quota=quota))
    with pytest.raises(ResourceExhausted, match="tenant 'a'"):
        quotas.admit(make_tenant("a", quota=quota))


def test_reload_changes_rates_but_keeps_levels_and_in_flight(clock):
    quotas = TenantQuotas(clock)
    old = make_tenant(quota=make_quota(requests_per_s=1, requests_burst=10, max_in_flight=10))
    quotas.update([old])
    leases = [quotas.admit(old) for _ in range(10)]  # bucket empty, 10 in flight
    new = make_tenant(quota=make_quota(requests_per_s=100, requests_burst=10, max_in_flight=20))
    quotas.update([new])

    assert quotas.num_in_flight("acme") == 10
    with pytest.raises(ResourceExhausted) as info:
        quotas.admit(new)  # a reload does not refill the bucket
    assert info.value.retry_after_s == pytest.approx(0.01)  # new rate applies
    for lease in leases:
        lease.release()
    assert quotas.num_in_flight("acme") == 0


def test_removed_tenant_lease_still_releases(clock):
    quotas = TenantQuotas(clock)
    tenant = make_tenant()
    quotas.update([tenant])
    lease = quotas.admit(tenant)
    quotas.update([])
    assert lease.release() == 0
    assert quotas.num_in_flight("acme") == 0
