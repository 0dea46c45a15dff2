"""What quotas across gateways cost: the admission hot path, and one lease sync against a real Valkey.

    .venv/bin/python -m bench.gateway.bench_quota_store [--tenants 1,10,100,1000] [--syncs 200] [--repeats 3]

* admit(): CPU per admitted request, TenantQuotas (per-gateway buckets) vs SharedQuotas
  (leased slices), in process. The hot path must not get slower: it never calls the store.
* sync: wall time of one lease round (plan -> the Lua script -> apply) for N tenants that all
  had demand, against a valkey-server started for the bench on 127.0.0.1 (tools/testbed/valkey.py).
  The sync runs every --quota-lease-interval-ms (100) and must finish well inside it, or the
  gateway falls back.
Prints a table and writes bench/results/quota_store.json.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.harness.results import RESULTS_DIR, write_report
from bench.harness.stats import quantile
from services.common.priority import Priority
from services.gateway.quota.lease import LeaseConfig, LeaseReply, SharedQuotas, TenantGrant
from services.gateway.quota.quotas import TenantQuotas
from services.gateway.quota.store import ValkeyQuotaStore
from services.gateway.tenants.directory import Tenant, TenantQuota
from tools.testbed.valkey import running_valkey

RESULTS = RESULTS_DIR / "quota_store.json"
ROOMY = TenantQuota(requests_per_s=1e9, requests_burst=10**9, tokens_per_s=1e9, tokens_burst=10**9,
                    max_in_flight=10**6)


def _tenants(num: int) -> list[Tenant]:
    return [Tenant(f"t{i}", Priority.STANDARD, 1, frozenset({"*"}), ROOMY, ("0" * 64,)) for i in range(num)]


def bench_admit(num_admits: int) -> dict[str, float]:
    """CPU microseconds per admit + release."""
    tenant = _tenants(1)[0]
    local = TenantQuotas(time.monotonic)
    local.update([tenant])
    shared = SharedQuotas(time.monotonic, LeaseConfig())
    shared.update([tenant])
    shared.plan()
    shared.apply(LeaseReply(1, (TenantGrant(tenant.tenant_id, 1e12, 1e12, 10**6),)))
    out = {}
    for name, quotas in (("per_gateway", local), ("leased", shared)):
        start_s = time.process_time()
        for _ in range(num_admits):
            quotas.admit(tenant, 100).release(60)
        out[name] = (time.process_time() - start_s) / num_admits * 1e6
    return out


async def bench_sync(address: str, num_tenants: int, num_syncs: int) -> dict[str, float]:
    """Wall milliseconds per sync round for `num_tenants` tenants with demand."""
    tenants = _tenants(num_tenants)
    quotas = SharedQuotas(time.monotonic, LeaseConfig())
    quotas.update(tenants)
    store = ValkeyQuotaStore(address, f"bench{num_tenants}:", gateway_id="bench", ttl_s=5.0, timeout_s=5.0)
    durations_ms = []
    try:
        for _ in range(num_syncs):
            for tenant in tenants:  # demand, so every tenant returns and leases something
                try:
                    quotas.admit(tenant, 10).release()
                except Exception:  # noqa: BLE001 - a refusal is demand too
                    pass
            start_s = time.perf_counter()
            quotas.apply(await store.sync(quotas.plan()))
            durations_ms.append((time.perf_counter() - start_s) * 1000)
    finally:
        await store.close()
    return {"p50_ms": statistics.median(durations_ms), "p99_ms": quantile(durations_ms, 0.99),
            "max_ms": max(durations_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", default="1,10,100,1000")
    parser.add_argument("--syncs", type=int, default=200)
    parser.add_argument("--admits", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one repeat, a tenth of the admits (make bench QUICK=1)")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.admits = 1, max(1, args.admits // 10)
    tenant_counts = [int(n) for n in args.tenants.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as workdir, running_valkey(Path(workdir)) as server:
        for repeat in range(args.repeats):
            admit = bench_admit(args.admits)
            syncs = {n: asyncio.run(bench_sync(server.address, n, args.syncs)) for n in tenant_counts}
            runs.append({"admit_cpu_us": admit, "sync": syncs})
            print(f"run {repeat + 1}: admit+release CPU per request: per-gateway {admit['per_gateway']:.2f} us, "
                  f"leased {admit['leased']:.2f} us")
            print("  tenants | sync p50 ms | p99 ms | max ms")
            for n, row in syncs.items():
                print(f"  {n:7d} | {row['p50_ms']:11.2f} | {row['p99_ms']:6.2f} | {row['max_ms']:6.2f}")
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[:3]
    write_report(RESULTS, {"args": vars(args), "loadavg_after": load, "runs": runs},
                 note=f"; load average after: {' '.join(load)}")


if __name__ == "__main__":
    main()
