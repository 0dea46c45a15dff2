"""The background loop that keeps SharedQuotas' slices leased from the shared store.

Every lease interval: plan -> one script call -> apply; on any failure the gateway falls back
(quota / live gateways) and tries again next interval. Transitions are logged once each (store
lost, store back), never per request or per failed attempt. Garbage found in the store is
logged once per key, and an audit every `audit_interval_s` reports keys of tenants not in the file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterable

from prometheus_client import Counter, Gauge

from services.common.cancellation import raise_if_cancelling
from services.gateway.quota.lease import LeaseMode, LeasePlan, SharedQuotas
from services.gateway.quota.store import ValkeyQuotaStore

log = logging.getLogger(__name__)

STORE_UP = Gauge(
    "infermesh_gateway_quota_store_up",
    "1 while tenant quotas are leased from the shared store; 0 while this gateway enforces its "
    "fallback share (store unreachable), or has no store configured.",
)
LIVE_GATEWAYS = Gauge(
    "infermesh_gateway_quota_live_gateways",
    "Gateways the quota store last reported alive (the fallback divisor); 1 with no store.",
)
BAD_STORE_KEYS = Counter(
    "infermesh_gateway_quota_store_bad_keys",
    "Store keys or entries with garbage that a quota sync ignored or reset.",
)
LIVE_GATEWAYS.set(1)

# Remembered so each bad key is logged once, not every interval; bounded against a store full of junk.
_MAX_REMEMBERED_KEYS = 1000


def default_gateway_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class QuotaSync:
    def __init__(
        self,
        quotas: SharedQuotas,
        store: ValkeyQuotaStore,
        *,
        audit_interval_s: float = 60.0,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._quotas = quotas
        self._store = store
        self._audit_interval_s = audit_interval_s
        self._sleep = sleep
        self._rng = rng
        self._reported: set[str] = set()
        self._logged_unreachable = False
        LIVE_GATEWAYS.set(quotas.num_live_gateways)

    async def run(self) -> None:
        interval_s = self._quotas.config.interval_s
        num_syncs_per_audit = max(1, round(self._audit_interval_s / interval_s))
        num_syncs = 0
        while True:  # the first sync_once() is the caller's, before it serves
            # Jittered (0.5-1.5 x interval): a sync takes what refilled since the previous one by
            # any gateway, so gateways whose phases stayed locked would split the quota unevenly.
            await self._sleep(interval_s * (0.5 + self._rng()))
            await self.sync_once()
            if num_syncs % num_syncs_per_audit == 0 and self._quotas.mode is LeaseMode.LEASED:
                await self.audit_once()
            num_syncs += 1
            raise_if_cancelling()  # the store's client may have swallowed a cancel: end as asked

    async def sync_once(self) -> bool:
        """One lease round; True when the store answered."""
        plan = self._quotas.plan()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
            # lands as the store answers (CPython gh-86296), and then the cancelled loop syncs on
            # forever and the gateway's close() waits for it (a suite run hung 300 s on this).
            async with asyncio.timeout(self._store.timeout_s):
                reply = await self._store.sync(plan)
        except Exception as exc:  # noqa: BLE001 - any failure of the store means: fall back
            started = self._quotas.store_unreachable()
            STORE_UP.set(0)
            if started or not self._logged_unreachable:
                self._logged_unreachable = True
                log.warning(
                    "quota store %s unreachable (%s): enforcing this gateway's share, quota / %d "
                    "live gateways, until it answers again",
                    self._store.address, _describe(exc), self._quotas.num_live_gateways,
                )
            return False
        resumed = self._quotas.apply(reply)
        STORE_UP.set(1)
        LIVE_GATEWAYS.set(self._quotas.num_live_gateways)
        if resumed:
            self._logged_unreachable = False
            log.info("quota store %s answering: leasing tenant quotas across %d live gateways",
                     self._store.address, self._quotas.num_live_gateways)
        self._report(reply.bad_keys, "held garbage; ignored it (a tenant is never trusted past its quota)")
        return True

    async def audit_once(self) -> None:
        try:
            async with asyncio.timeout(5.0):
                strange = await self._store.audit(self._quotas.tenant_ids())
        except Exception as exc:  # noqa: BLE001 - the audit is advisory; the next sync reports outages
            log.debug("quota store audit failed: %s", _describe(exc))
            return
        self._report(strange, "is not a key of any tenant in the tenants file; ignored")

    def _report(self, keys: Iterable[str], what: str) -> None:
        for key in keys:
            if key in self._reported or len(self._reported) >= _MAX_REMEMBERED_KEYS:
                continue
            self._reported.add(key)
            BAD_STORE_KEYS.inc()
            log.warning("quota store key %s %s", key, what)


    async def close(self) -> None:
        """Leave the store: give the slices back and free this gateway's slots and registration now,
        not a TTL later (the server has stopped: nothing is in flight any more). Best effort."""
        if self._quotas.mode is LeaseMode.LEASED:
            plan = self._quotas.plan()
            leave = LeasePlan(tuple(
                dataclasses.replace(ask, want_requests=0.0, want_tokens=0.0, floor_requests=0.0, floor_tokens=0.0,
                                    num_in_flight=0, want_in_flight=0)
                for ask in plan.asks))
            try:
                async with asyncio.timeout(self._store.timeout_s):
                    await self._store.sync(leave, leaving=True)
            except Exception as exc:  # noqa: BLE001 - the TTL frees everything anyway
                log.info("quota store %s: could not leave (%s); its TTL frees this gateway's share",
                         self._store.address, _describe(exc))
        await self._store.close()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
