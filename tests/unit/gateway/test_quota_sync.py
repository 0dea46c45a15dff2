"""QuotaSync's loop with a fake store: jittered intervals, one log line per outage and per bad key,
the audit, the gauges (no Valkey, no sleeps)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.gateway.quota.lease import LeaseConfig, LeaseMode, LeaseReply, SharedQuotas, TenantGrant
from services.gateway.quota.sync import BAD_STORE_KEYS, LIVE_GATEWAYS, STORE_UP, QuotaSync

from .conftest import make_quota, make_tenant


class FakeStore:
    address = "store:6379"
    timeout_s = 0.5

    def __init__(self) -> None:
        self.replies: list = []  # LeaseReply, or an exception to raise
        self.audits: list[frozenset[str]] = []
        self.strange: list[str] = []
        self.plans: list = []
        self.closed = False

    async def sync(self, plan, *, leaving=False):
        self.plans.append((plan, leaving))
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def audit(self, known_tenants):
        self.audits.append(frozenset(known_tenants))
        return list(self.strange)

    async def close(self) -> None:
        self.closed = True


def _reply(live=2, bad=()) -> LeaseReply:
    return LeaseReply(live, (TenantGrant("acme", 5, 50, 3),), bad)


@pytest.fixture
def quotas(clock) -> SharedQuotas:
    quotas = SharedQuotas(clock, LeaseConfig(interval_s=0.1, expected_gateways=3))
    quotas.update([make_tenant(quota=make_quota())])
    return quotas


async def test_outage_is_logged_once_and_the_return_once(quotas, caplog):
    caplog.set_level(logging.INFO, logger="services.gateway.quota.sync")
    store = FakeStore()
    store.replies = [ConnectionError("refused"), TimeoutError(), _reply(live=2), OSError("reset"), _reply()]
    sync = QuotaSync(quotas, store)
    assert LIVE_GATEWAYS._value.get() == 3  # the expected count until the store says otherwise
    outcomes = [await sync.sync_once() for _ in range(5)]
    assert outcomes == [False, False, True, False, True]
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" (")[0] for line in lines] == [
        "quota store store:6379 unreachable",
        "quota store store:6379 answering: leasing tenant quotas across 2 live gateways",
        "quota store store:6379 unreachable",
        "quota store store:6379 answering: leasing tenant quotas across 2 live gateways",
    ]
    assert "quota / 3 live gateways" in lines[0] and "quota / 2 live gateways" in lines[2]
    assert STORE_UP._value.get() == 1 and LIVE_GATEWAYS._value.get() == 2


async def test_bad_keys_and_strange_keys_are_logged_once_each(quotas, caplog):
    caplog.set_level(logging.WARNING, logger="services.gateway.quota.sync")
    store = FakeStore()
    store.replies = [_reply(bad=("k1 (junk)",)), _reply(bad=("k1 (junk)", "k2 (junk)"))]
    store.strange = ["p:t:ghost:requests"]
    sync = QuotaSync(quotas, store)
    before = BAD_STORE_KEYS._value.get()
    await sync.sync_once()
    await sync.sync_once()
    await sync.audit_once()
    await sync.audit_once()
    assert store.audits == [frozenset({"acme"})] * 2
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "quota store key k1 (junk) held garbage; ignored it (a tenant is never trusted past its quota)",
        "quota store key k2 (junk) held garbage; ignored it (a tenant is never trusted past its quota)",
        "quota store key p:t:ghost:requests is not a key of any tenant in the tenants file; ignored",
    ]
    assert BAD_STORE_KEYS._value.get() == before + 3


async def test_run_sleeps_a_jittered_interval_and_audits_only_while_leased(quotas):
    store = FakeStore()
    store.replies = [ConnectionError("refused"), _reply(), _reply()]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) > 3:
            raise asyncio.CancelledError

    draws = iter([0.0, 1.0, 0.5, 0.5])
    sync = QuotaSync(quotas, store, audit_interval_s=0.2, sleep=sleep, rng=lambda: next(draws))
    with pytest.raises(asyncio.CancelledError):
        await sync.run()
    assert slept[:3] == pytest.approx([0.05, 0.15, 0.1])  # 0.5-1.5 x the 100 ms interval
    # Every second sync (audit_interval_s / interval): not after the first, which failed; after the third.
    assert len(store.audits) == 1
    assert quotas.mode is LeaseMode.LEASED


async def test_close_gives_everything_back_when_leased_and_only_closes_in_fallback(quotas):
    store = FakeStore()
    store.replies = [_reply(), _reply()]
    sync = QuotaSync(quotas, store)
    await sync.sync_once()
    await sync.close()
    plan, leaving = store.plans[-1]
    assert leaving is True and store.closed
    (ask,) = plan.asks
    assert (ask.want_requests, ask.want_tokens, ask.want_in_flight, ask.num_in_flight) == (0, 0, 0, 0)
    assert ask.return_requests == pytest.approx(5)  # the whole slice goes back

    fallback_store = FakeStore()
    fallback_store.replies = [ConnectionError("refused")]
    sync = QuotaSync(quotas, fallback_store)
    await sync.sync_once()
    await sync.close()
    assert len(fallback_store.plans) == 1 and fallback_store.closed  # nothing leased: nothing to return


class AnsweringStore(FakeStore):
    """A store whose sync waits until the test answers it."""

    def __init__(self) -> None:
        super().__init__()
        self.answer: asyncio.Future | None = None
        self.asked = asyncio.Event()

    async def sync(self, plan, *, leaving=False):
        self.plans.append((plan, leaving))
        self.answer = asyncio.get_running_loop().create_future()
        self.asked.set()
        return await self.answer


async def test_cancelling_the_loop_as_the_store_answers_stops_it(quotas):
    """The gateway's close() cancels the loop and waits for it. Python 3.11's wait_for returned the
    store's reply instead of raising when both landed in one tick (CPython gh-86296), and the loop
    synced on forever: a suite run hung 300 s in close()."""
    store = AnsweringStore()

    async def no_sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    sync = QuotaSync(quotas, store, sleep=no_sleep)
    loop = asyncio.create_task(sync.run())
    await store.asked.wait()
    assert store.answer is not None
    store.answer.set_result(_reply())
    loop.cancel()  # the same tick as the answer
    done, _ = await asyncio.wait({loop}, timeout=5.0)
    assert done == {loop} and loop.cancelled()


class SwallowingStore(AnsweringStore):
    """A store whose client catches the cancellation and answers anyway, as valkey's sometimes did."""

    async def sync(self, plan, *, leaving=False):
        try:
            return await super().sync(plan, leaving=leaving)
        except asyncio.CancelledError:
            return _reply()


async def test_the_loop_ends_when_the_stores_client_swallows_the_cancel(quotas):
    store = SwallowingStore()

    async def sleep(seconds: float) -> None:
        await asyncio.sleep(0)

    sync = QuotaSync(quotas, store, sleep=sleep)
    loop = asyncio.create_task(sync.run())
    await store.asked.wait()
    loop.cancel()  # lands inside the store's sync, which swallows it
    done, _ = await asyncio.wait({loop}, timeout=5.0)
    assert done == {loop} and loop.cancelled()
