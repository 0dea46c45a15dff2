"""The quota store's script against a real valkey-server (tools/testbed/valkey.py), and the sync
loop's fallback and re-sync when that server is killed and comes back."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time

import pytest
import valkey.asyncio as valkey_asyncio
import valkey.exceptions as valkey_exceptions

from services.gateway.quota.lease import LeaseConfig, LeaseMode, LeasePlan, SharedQuotas, TenantAsk
from services.gateway.quota.quotas import QuotaExceeded
from services.gateway.quota.store import LateSync, StoreReplyError, ValkeyQuotaStore, _parse_reply
from services.gateway.quota.sync import LIVE_GATEWAYS, STORE_UP, QuotaSync
from services.gateway.tenants.directory import TenantQuota
from tools.testbed.valkey import ValkeyProcess, running_valkey

from .conftest import make_quota, make_tenant

_prefixes = itertools.count()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_valkey(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture
def prefix() -> str:
    return f"test{next(_prefixes)}:"  # one namespace per test: they share the server


@pytest.fixture
async def raw(server):
    client = valkey_asyncio.Valkey(host="127.0.0.1", port=server.port, decode_responses=True)
    yield client
    await client.aclose()


def _store(server, prefix, gateway_id, ttl_s=5.0) -> ValkeyQuotaStore:
    return ValkeyQuotaStore(server.address, prefix, gateway_id=gateway_id, ttl_s=ttl_s, timeout_s=2.0)


def _ask(quota, want_requests=0.0, return_requests=0.0, want_tokens=0.0, num_in_flight=0, want_in_flight=0,
         tenant_id="acme", floor_requests=0.0) -> LeasePlan:
    return LeasePlan((TenantAsk(tenant_id, quota, return_requests, return_tokens=0.0, want_requests=want_requests,
                                want_tokens=want_tokens, num_in_flight=num_in_flight,
                                want_in_flight=want_in_flight, floor_requests=floor_requests),))


# A rate slow enough that the refill during a test (well under a second) is below one request.
SLOW = make_quota(requests_per_s=0.1, requests_burst=10, tokens_per_s=0.1, tokens_burst=400, max_in_flight=6)


async def test_grants_across_gateways_never_exceed_the_bucket_and_returns_go_back(server, prefix):
    stores = [_store(server, prefix, f"gw{i}") for i in range(3)]
    grants = [(await store.sync(_ask(SLOW, want_requests=4))).grants[0].requests for store in stores]
    assert grants == [pytest.approx(4), pytest.approx(4), pytest.approx(2, abs=0.1)]  # burst 10
    reply = await stores[0].sync(_ask(SLOW, want_requests=4, return_requests=3))
    assert reply.grants[0].requests == pytest.approx(3, abs=0.1)  # only what gw0 gave back is there
    assert reply.num_live_gateways == 3
    for store in stores:
        await store.close()


async def test_in_flight_slots_are_leased_never_oversubscribed_and_shared_fairly_when_contended(server, prefix):
    first, second, third = (_store(server, prefix, f"gw{i}") for i in range(3))
    assert (await first.sync(_ask(SLOW, num_in_flight=0, want_in_flight=6))).grants[0].in_flight_limit == 6
    # Contended: second wants 6 too; the first holds all of them.
    assert (await second.sync(_ask(SLOW, want_in_flight=6))).grants[0].in_flight_limit == 0
    # The first sees the contention and shrinks to its fair share (6 / 2), keeping what runs (2).
    assert (await first.sync(_ask(SLOW, num_in_flight=2, want_in_flight=6))).grants[0].in_flight_limit == 3
    assert (await second.sync(_ask(SLOW, want_in_flight=6))).grants[0].in_flight_limit == 3
    # A third gateway: its fair share is 6 / 3 = 2, but only what the others do not hold.
    assert (await third.sync(_ask(SLOW, want_in_flight=6))).grants[0].in_flight_limit == 0
    assert (await first.sync(_ask(SLOW, num_in_flight=2, want_in_flight=6))).grants[0].in_flight_limit == 2
    assert (await second.sync(_ask(SLOW, num_in_flight=0, want_in_flight=6))).grants[0].in_flight_limit == 2
    assert (await third.sync(_ask(SLOW, want_in_flight=6))).grants[0].in_flight_limit == 2
    for store in (first, second, third):
        await store.close()


async def test_a_gateway_that_stops_syncing_frees_its_slots_and_leaves_the_live_count(server, prefix, raw):
    gone, stays = _store(server, prefix, "gone"), _store(server, prefix, "stays")
    await gone.sync(_ask(SLOW, want_in_flight=6))
    # Age gone's registration and lease as if its TTL had run out (the store's clock cannot be faked).
    await raw.zadd(f"{prefix}gateways", {"gone": 1})
    await raw.hset(f"{prefix}t:acme:in_flight", "gone", "6:6:1")
    reply = await stays.sync(_ask(SLOW, want_in_flight=6))
    assert reply.num_live_gateways == 1
    assert reply.grants[0].in_flight_limit == 6
    assert await raw.hkeys(f"{prefix}t:acme:in_flight") == ["stays"]
    await gone.close()
    await stays.close()


@pytest.mark.parametrize("garbage", ["not-a-number", "-5", "nan", "inf"])
async def test_a_garbage_level_is_an_empty_bucket_and_reported(server, prefix, raw, garbage):
    await raw.hset(f"{prefix}t:acme:requests", mapping={"level": garbage, "ts_ms": "0"})
    store = _store(server, prefix, "gw")
    reply = await store.sync(_ask(SLOW, want_requests=5))
    assert reply.grants[0].requests == pytest.approx(0, abs=0.1)
    assert reply.bad_keys == (f"{prefix}t:acme:requests (level/ts_ms not numbers >= 0)",)
    # Rewritten as a real (empty) bucket: the next sync finds nothing wrong.
    assert (await store.sync(_ask(SLOW, want_requests=5))).bad_keys == ()
    await store.close()


async def test_a_level_above_the_burst_is_capped(server, prefix, raw):
    await raw.hset(f"{prefix}t:acme:requests", mapping={"level": "1e9", "ts_ms": "0"})
    store = _store(server, prefix, "gw")
    reply = await store.sync(_ask(SLOW, want_requests=1000))
    assert reply.grants[0].requests == pytest.approx(10)  # the burst, not the stored billion
    await store.close()


async def test_keys_of_the_wrong_type_are_replaced_and_reported(server, prefix, raw):
    await raw.set(f"{prefix}t:acme:requests", "garbage")
    await raw.rpush(f"{prefix}t:acme:in_flight", "x")
    await raw.set(f"{prefix}gateways", "7")
    store = _store(server, prefix, "gw")
    reply = await store.sync(_ask(SLOW, want_requests=5, want_in_flight=6))
    assert reply.grants[0].requests == pytest.approx(0, abs=0.1)  # reset to empty, never full
    assert reply.grants[0].in_flight_limit == 6
    assert reply.num_live_gateways == 1
    assert sorted(reply.bad_keys) == sorted([
        f"{prefix}gateways (a string, expected a zset)",
        f"{prefix}t:acme:requests (a string, expected a hash)",
        f"{prefix}t:acme:in_flight (a list, expected a hash)",
    ])
    await store.close()


async def test_foreign_in_flight_entries_and_registry_members_are_dropped(server, prefix, raw):
    await raw.hset(f"{prefix}t:acme:in_flight", mapping={
        "junk": "lots", "huge": "999:999:99999999999999", "negative": "-1:0:99999999999999",
    })
    await raw.zadd(f"{prefix}gateways", {"from-the-future": 9e15})
    store = _store(server, prefix, "gw")
    reply = await store.sync(_ask(SLOW, want_in_flight=6))
    assert reply.grants[0].in_flight_limit == 6
    assert reply.num_live_gateways == 1
    assert len(reply.bad_keys) == 4
    assert all("in_flight field" in key or "from-the-future" in key for key in reply.bad_keys)
    await store.close()


async def test_audit_reports_keys_of_unknown_tenants_and_unknown_layouts(server, prefix, raw):
    store = _store(server, prefix, "gw")
    await store.sync(_ask(SLOW, want_requests=1))
    await raw.set(f"{prefix}t:ghost:requests", "1")
    await raw.set(f"{prefix}whatever", "1")
    await raw.set("elsewhere:t:ghost:requests", "1")  # outside the prefix: not ours to judge
    assert sorted(await store.audit({"acme"})) == [f"{prefix}t:ghost:requests", f"{prefix}whatever"]
    await store.close()


async def test_sync_loop_falls_back_when_the_store_dies_and_re_syncs_when_it_returns(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="services.gateway.quota.sync")
    server = ValkeyProcess(tmp_path).start()
    try:
        quotas = SharedQuotas(lambda: 0.0, LeaseConfig(interval_s=0.5, expected_gateways=2))
        tenant = make_tenant(quota=make_quota(requests_per_s=100, requests_burst=90, max_in_flight=9))
        quotas.update([tenant])
        sync = QuotaSync(quotas, _store(server, "loop:", "gw", ttl_s=5.0))
        assert await sync.sync_once() is True
        assert quotas.mode is LeaseMode.LEASED and STORE_UP._value.get() == 1
        assert LIVE_GATEWAYS._value.get() == 1
        server.kill()
        assert await sync.sync_once() is False
        assert await sync.sync_once() is False
        assert quotas.mode is LeaseMode.FALLBACK and STORE_UP._value.get() == 0
        lost = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(lost) == 1  # one line, not one per failed sync
        server.start()  # same port, empty: buckets read as full again
        assert await sync.sync_once() is True
        assert quotas.mode is LeaseMode.LEASED and STORE_UP._value.get() == 1
        assert any("answering" in r.getMessage() for r in caplog.records)
        await sync.close()
    finally:
        server.stop()


async def test_a_sync_the_store_runs_after_its_gateway_gave_up_leases_nothing(tmp_path):
    """A hung store (SIGSTOP) runs the syncs queued in its sockets once it resumes, after their
    gateways timed out and fell back: their grants were taken from the shared buckets and never
    used or given back, and the gateways' next real syncs were refused for lack of them (fault
    probe: 2-3 false 'over its request rate quota' refusals right after the store came back)."""
    server = ValkeyProcess(tmp_path).start()
    quota = make_quota(requests_per_s=0.001, requests_burst=10, tokens_per_s=0.001, tokens_burst=400)
    hasty = ValkeyQuotaStore(server.address, "hung:", gateway_id="gw0", ttl_s=5.0, timeout_s=0.2)
    patient = _store(server, "hung:", "gw1")
    try:
        assert (await hasty.sync(_ask(quota, want_requests=1))).grants[0].requests == 1  # the clock offset
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(3):  # each times out with its script sent, as a sync loop's would
                with pytest.raises((TimeoutError, valkey_exceptions.TimeoutError)):
                    await asyncio.wait_for(hasty.sync(_ask(quota, want_requests=3)), timeout=hasty.timeout_s)
            await asyncio.sleep(0.3)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        # The 9 requests the late syncs asked for are still in the bucket (burst 10, 1 leased).
        assert (await patient.sync(_ask(quota, want_requests=9))).grants[0].requests == 9
    finally:
        await hasty.close()
        await patient.close()
        server.stop()


async def test_a_store_clock_that_stepped_forward_costs_one_sync_not_every_one(server, prefix):
    now_ms = [1_000_000.0]
    store = ValkeyQuotaStore(server.address, prefix, gateway_id="gw", ttl_s=5.0, timeout_s=2.0,
                             clock_ms=lambda: now_ms[0])
    try:
        assert (await store.sync(_ask(SLOW, want_requests=1))).grants[0].requests == 1
        now_ms[0] -= 60_000  # ours stepped back a minute: as if the store's stepped forward
        with pytest.raises(LateSync):
            await store.sync(_ask(SLOW, want_requests=1))
        assert (await store.sync(_ask(SLOW, want_requests=1))).grants[0].requests == 1
    finally:
        await store.close()


async def test_a_gateway_with_no_tenants_still_registers(server, prefix):
    store = _store(server, prefix, "gw")
    reply = await store.sync(LeasePlan(()))
    assert reply.grants == () and reply.num_live_gateways == 1
    await store.close()


async def test_requests_are_leased_whole_and_token_fractions_survive_the_reply(server, prefix):
    store = _store(server, prefix, "gw")
    quota = make_quota(requests_per_s=0.001, requests_burst=10, tokens_per_s=0.001, tokens_burst=400)
    reply = await store.sync(_ask(quota, want_requests=2.5, want_tokens=0.25))
    assert reply.grants[0].requests == 2 and reply.grants[0].tokens == pytest.approx(0.25)
    await store.close()


async def test_spare_slots_are_headroom_and_move_to_the_gateway_that_needs_them(server, prefix):
    async def slots(store, num_in_flight, wanted) -> int:
        reply = await store.sync(_ask(SLOW, num_in_flight=num_in_flight, want_in_flight=wanted))
        return reply.grants[0].in_flight_limit

    first, second = _store(server, prefix, "gw0"), _store(server, prefix, "gw1")
    assert await slots(first, 0, 1) == 6  # alone: a burst may fill the whole quota at once
    assert await slots(second, 0, 1) == 0  # the first holds it all until its next sync
    assert await slots(first, 0, 1) == 3  # wants 1, plus half of the 4 nobody wants
    assert await slots(second, 0, 1) == 3
    # The second gets busy: it may take what the first is not entitled to, once the first lets go.
    assert await slots(second, 3, 6) == 3
    assert await slots(first, 0, 1) == 1
    assert await slots(second, 3, 6) == 5
    for store in (first, second):
        await store.close()


async def test_extreme_quotas_are_leased(server, prefix):
    store = _store(server, prefix, "gw")
    tiny_rate = make_quota(requests_per_s=1e-6, requests_burst=10**9, tokens_per_s=1e-6, tokens_burst=10**9)
    reply = await store.sync(_ask(tiny_rate, want_requests=3, want_tokens=5))
    assert (reply.grants[0].requests, reply.grants[0].tokens) == (pytest.approx(3), pytest.approx(5))
    await store.close()


async def test_fair_shares_add_up_to_the_quota_so_no_gateway_is_left_out(server, prefix):
    """max_in_flight 4 over 3 busy gateways: 1 each and the remaining slot to one of them (by id,
    rotating; here it never rotates), not ceil(4 / 3) = 2 to two of them and 0 to the third."""
    stores = [ValkeyQuotaStore(server.address, prefix, gateway_id=f"gw{i}", ttl_s=5.0, timeout_s=2.0,
                               share_rotation_s=1e9)  # no rotation during the test
              for i in range(3)]
    quota = make_quota(requests_per_s=0.1, requests_burst=10, max_in_flight=4)
    grants = [(await store.sync(_ask(quota, want_in_flight=4))).grants[0].in_flight_limit for store in stores]
    assert grants == [4, 0, 0]  # the first alone took everything; the others are now registered
    for _ in range(2):  # each lets go of what it is not entitled to; the next takes it
        grants = [(await store.sync(_ask(quota, want_in_flight=4))).grants[0].in_flight_limit for store in stores]
    assert sorted(grants) == [1, 1, 2]
    for store in stores:
        await store.close()


async def test_a_leaving_gateway_gives_back_its_slices_and_slots_at_once(server, prefix, raw):
    leaving, staying = _store(server, prefix, "leaving"), _store(server, prefix, "staying")
    taken = await leaving.sync(_ask(SLOW, want_requests=10, want_in_flight=6))
    assert (taken.grants[0].requests, taken.grants[0].in_flight_limit) == (pytest.approx(10), 6)
    await leaving.sync(_ask(SLOW, return_requests=10), leaving=True)
    reply = await staying.sync(_ask(SLOW, want_requests=10, want_in_flight=6))
    assert reply.num_live_gateways == 1
    assert (reply.grants[0].requests, reply.grants[0].in_flight_limit) == (pytest.approx(10, abs=0.1), 6)
    assert await raw.zrange(f"{prefix}gateways", 0, -1) == ["staying"]
    for store in (leaving, staying):
        await store.close()


async def test_idle_headroom_comes_only_from_what_no_busy_gateway_wants(server, prefix):
    quota = make_quota(requests_per_s=0.01, requests_burst=2)
    busy, idle = _store(server, prefix, "busy"), _store(server, prefix, "idle")
    assert (await busy.sync(_ask(quota, want_requests=1))).grants[0].requests == 1
    # One request is left, but the busy gateway wants one per sync: the idle one does not park it.
    assert (await idle.sync(_ask(quota, floor_requests=1))).grants[0].requests == 0
    assert (await busy.sync(_ask(quota, want_requests=1))).grants[0].requests == 1
    # Nobody wants anything: headroom is granted.
    await busy.sync(_ask(quota, return_requests=2))
    assert (await idle.sync(_ask(quota, floor_requests=1))).grants[0].requests == 1
    for store in (busy, idle):
        await store.close()


async def test_garbage_demand_fields_are_dropped_and_reported(server, prefix, raw):
    await raw.hset(f"{prefix}t:acme:requests", mapping={
        "level": "2", "ts_ms": "0", "d:ghost": "lots", "d:greedy": "1e9:99999999999999", "stray": "1"})
    store = _store(server, prefix, "gw")
    reply = await store.sync(_ask(SLOW, floor_requests=1))
    assert reply.grants[0].requests == 1  # the garbage demand did not hold the headroom back
    assert len(reply.bad_keys) == 3 and all("field" in key for key in reply.bad_keys)
    assert sorted(await raw.hkeys(f"{prefix}t:acme:requests")) == ["level", "ts_ms"]
    await store.close()


@pytest.mark.slow
@pytest.mark.parametrize("busy", [(0,), (0, 1, 2)], ids=["one-busy", "all-busy"])
async def test_a_slow_tenant_gets_its_rate_across_three_gateways(server, prefix, busy):
    """Three gateways leasing from one store with their real sync loops, for 3 s of the store's real
    clock: a tenant of 4 requests/s, burst 2, asked 100 times a second, gets burst + rate x time,
    give or take the request in progress, however its load is spread. (Fractional slices spread
    over gateways, or headroom parked by idle ones, used to cost slow tenants up to 2/3 of their rate.)"""
    quota = make_quota(requests_per_s=4, requests_burst=2, max_in_flight=100)
    tenant = make_tenant(quota=quota)
    gateways = []
    for index in range(3):
        quotas = SharedQuotas(time.monotonic, LeaseConfig(expected_gateways=3))
        quotas.update([tenant])
        sync = QuotaSync(quotas, _store(server, prefix, f"gw{index}", ttl_s=1.0))
        await sync.sync_once()
        gateways.append((quotas, sync))
    loops = [asyncio.create_task(sync.run()) for _, sync in gateways]
    admitted = 0
    start_s = time.monotonic()
    while time.monotonic() - start_s < 3.0:
        for index in busy:
            try:
                gateways[index][0].admit(tenant).release()
                admitted += 1
            except QuotaExceeded:
                pass
        await asyncio.sleep(0.01)  # the offered load's pacing
    for loop in loops:
        loop.cancel()
    await asyncio.gather(*loops, return_exceptions=True)
    for _, sync in gateways:
        await sync.close()
    assert 2 + 4 * 3.0 - 2 <= admitted <= 2 + 4 * 3.0 + 1


async def test_a_lone_gateway_admits_a_whole_burst_at_once_as_its_own_bucket_would(server, prefix):
    quotas = SharedQuotas(time.monotonic, LeaseConfig())
    tenant = make_tenant(quota=make_quota(requests_per_s=0.01, requests_burst=50, max_in_flight=100))
    quotas.update([tenant])
    sync = QuotaSync(quotas, _store(server, prefix, "lone"))
    assert await sync.sync_once()  # idle: only headroom, which nobody else wants
    admitted = 0
    for _ in range(60):
        try:
            quotas.admit(tenant).release()
            admitted += 1
        except QuotaExceeded:
            pass
    assert admitted == 50
    await sync.close()


@pytest.mark.parametrize("raw", [
    [1, [], b'[1, "x", 3]', 5], [1, [], b"[1, {}, 3]", 5], [1, [], b"[1, 2, 1" + b"0" * 400 + b"]", 5],
    [b"x", [], b"[1, 2, 3]", 5], [None, [], b"[1, 2, 3]", 5], [1, [], b"[1, 2, 3]", b"noon"], [1, [], b"[1, 2, 3]", None], [b"late", b"nan"],
])
def test_a_sync_reply_with_values_that_are_not_numbers_is_a_store_reply_error(raw):
    # Found by atheris (fuzz/quota_reply.py): TypeError/ValueError/OverflowError escaped the parser.
    quota = TenantQuota(requests_per_s=10, requests_burst=20, tokens_per_s=100, tokens_burst=200, max_in_flight=4)
    plan = LeasePlan((TenantAsk("t0", quota, 0.0, 0.0, 5.0, 50.0, 1, 2),))
    with pytest.raises(StoreReplyError, match="not a number"):
        _parse_reply(raw, plan)
