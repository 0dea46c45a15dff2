"""The quota store's primary dies; Valkey Sentinel promotes its replica and the gateways' store client
follows (issue 35). `--quota-store-address sentinel://host:port/name` asks the sentinels for the
primary at every connection, so no gateway is restarted or reconfigured. Meanwhile syncs fail and the
gateways enforce their local share (tests/reliability/test_quota_across_gateways.py covers that
under load); here: how soon after the primary's death a sync succeeds on the promoted replica."""

from __future__ import annotations

import asyncio
import time

import pytest
import valkey

from services.gateway.quota.lease import LeasePlan, TenantAsk
from services.gateway.quota.store import ValkeyQuotaStore
from services.gateway.tenants.directory import TenantQuota
from tools.testbed.valkey import SentinelProcess, ValkeyProcess

pytestmark = pytest.mark.integration

QUOTA = TenantQuota(requests_per_s=10, requests_burst=20, tokens_per_s=100, tokens_burst=200, max_in_flight=4)
PLAN = LeasePlan((TenantAsk("t0", QUOTA, 0.0, 0.0, 5.0, 50.0, 1, 2),))


def _replica_in_sync(port: int) -> bool:
    info = valkey.Valkey(port=port, socket_timeout=1).info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def _role(port: int) -> str:
    return valkey.Valkey(port=port, socket_timeout=1).info("replication")["role"]


async def test_a_failover_to_the_replica_is_followed_within_seconds(tmp_path):
    primary = ValkeyProcess(tmp_path).start()
    replica = ValkeyProcess(tmp_path, extra_args=("--replicaof", "127.0.0.1", str(primary.port))).start()
    sentinel = SentinelProcess(tmp_path, primary.port).start()
    try:
        give_up = time.monotonic() + 10
        while not _replica_in_sync(replica.port):
            assert time.monotonic() < give_up, "the replica never synced"
            await asyncio.sleep(0.05)
        store = ValkeyQuotaStore(f"sentinel://127.0.0.1:{sentinel.port}/{sentinel.name}", "infermesh:quota:",
                                 gateway_id="g1", ttl_s=1.0, timeout_s=0.2)
        assert (await store.sync(PLAN)).grants, "leases from the primary through the sentinel"
        primary.kill()
        killed_at = time.monotonic()
        failures = 0
        while True:
            try:
                reply = await store.sync(PLAN)
                break
            except Exception:  # noqa: BLE001 - every failure kind while the primary is gone
                failures += 1
                assert time.monotonic() - killed_at < 20, f"no sync on a new primary: {sentinel.log_path.read_text()}"
                await asyncio.sleep(0.1)  # the gateway's lease interval: it retries at the next one
        recovered_s = time.monotonic() - killed_at
        assert reply.grants
        assert _role(replica.port) == "master"
        print(f"syncs failed for {recovered_s:.2f} s ({failures} attempts) until the promoted replica answered")
        await store.close()
    finally:
        for process in (sentinel, replica, primary):
            process.stop()
