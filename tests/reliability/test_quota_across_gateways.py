"""One tenant's quotas held across three gateways (issue 12): one tenant offers 3x its requests/s
quota spread evenly over three gateway processes (one scheduler, a mock classifier worker);
the rate admitted by all of them together never goes more than 10% past the quota (nor below half of it,
which gateways starved of CPU can come near)
  * with the shared Valkey store (slices leased from one bucket),
  * with the store never started (each gateway enforces quota / --quota-expected-gateways),
  * with the store SIGKILLed mid-load and restarted on the same port (fallback share, then re-sync);
and its in-flight limit and tokens/s (Generate streams, charged up front and settled) hold across
them through the store. Each prints its counts."""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import valkey

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.tenants.directory import hash_api_key
from tools.testbed import session_tls
from tools.testbed.processes import ServiceProcess, free_port, running_mesh
from tools.testbed.valkey import ValkeyProcess

pytestmark = pytest.mark.integration

QUOTA_PER_S = 20.0
OFFERED_PER_S = 3 * QUOTA_PER_S
NUM_GATEWAYS = 3
API_KEY = "quota-test-key"
IMAGE = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))
# Slices and the fallback bucket settle within a few lease intervals; the first second of a
# phase is not counted (it includes the burst and the switch between modes).
SETTLE_S = 1.0

# Burst 10: a sync gap longer than burst / rate (500 ms) loses refill at the bucket's cap, and on a
# CPU-starved 2-core box the gateways' loops can stall that long (burst 4 gave 18.67/s once at load 12).
TENANTS = f"""
tenants:
  - id: acme
    api_key_sha256: ["{hash_api_key(API_KEY)}"]
    priority: standard
    allowed_models: "*"
    quotas:
      requests_per_s: {QUOTA_PER_S}
      requests_burst: 10
      tokens_per_s: 100000
      tokens_burst: 100000
      max_in_flight: 200
"""


@dataclass(frozen=True)
class Outcome:
    sent_s: float
    gateway: int
    result: str  # OK | QUOTA | the status name of anything else
    duration_s: float = 0.0


def _classify(stub, gateway: int, sent_s: float) -> Outcome:
    began_s = time.monotonic()
    try:
        stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="mock-classifier"), image=IMAGE),
                      timeout=10, metadata=(("authorization", f"Bearer {API_KEY}"),))
        return Outcome(sent_s, gateway, "OK", time.monotonic() - began_s)
    except grpc.RpcError as exc:
        # Every tenant quota refusal names the tenant; the gateway's own limits do not.
        quota = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'acme'" in (exc.details() or "")
        return Outcome(sent_s, gateway, "QUOTA" if quota else f"{exc.code().name}: {exc.details()}")


def _offer_load(addresses: list[str], duration_s: float, on_tick=None) -> list[Outcome]:
    """Open loop at OFFERED_PER_S, round-robin over the gateways, for `duration_s`.
    `on_tick(elapsed_s)` runs on the sending thread between sends (to kill or restart the store)."""
    channels = [session_tls.channel(a) for a in addresses]
    stubs = [gateway_pb2_grpc.InferenceStub(c) for c in channels]
    futures = []
    try:
        with ThreadPoolExecutor(max_workers=24) as pool:
            start_s = time.monotonic()
            for index in range(int(duration_s * OFFERED_PER_S)):
                send_at_s = start_s + index / OFFERED_PER_S
                time.sleep(max(0.0, send_at_s - time.monotonic()))
                if on_tick is not None:
                    on_tick(time.monotonic() - start_s)
                gateway = index % len(stubs)
                futures.append(pool.submit(_classify, stubs[gateway], gateway, time.monotonic() - start_s))
            return [f.result() for f in futures]
    finally:
        for channel in channels:
            channel.close()


def _admitted_rate(outcomes: list[Outcome], from_s: float, to_s: float) -> tuple[float, dict]:
    window = [o for o in outcomes if from_s <= o.sent_s < to_s]
    counts = {"offered": len(window), "admitted": sum(o.result == "OK" for o in window),
              "refused_by_quota": sum(o.result == "QUOTA" for o in window),
              "per_gateway_admitted": [sum(o.result == "OK" and o.gateway == g for o in window)
                                       for g in range(NUM_GATEWAYS)]}
    return counts["admitted"] / (to_s - from_s), counts


def _start_gateways(mesh, tmp: Path, store_address: str, tenants_yaml: str = TENANTS) -> list[ServiceProcess]:
    tenants = tmp / "tenants.yaml"
    tenants.write_text(tenants_yaml)
    gateways = []
    for index in range(NUM_GATEWAYS):
        gateway = ServiceProcess(
            f"gateway{index}", "gateway", free_port(),
            ["--scheduler-address", mesh.scheduler.address, "--tenants-file", str(tenants),
             "--quota-store-address", store_address, "--quota-expected-gateways", str(NUM_GATEWAYS),
             "--quota-lease-interval-ms", "100", "--gateway-id", f"gw{index}",
             # These tests count quota refusals only: queue-time shedding stays out of the way (with 0.3 s
             # batches it shed critical calls at an estimated 0.57 s queue on a loaded CI box).
             "--shed-queue-slo-ms", "10000,10000,10000"],
            {}, tmp / f"gateway{index}.log",
        )
        mesh.processes.append(gateway)
        gateways.append(gateway.start())
    for gateway in gateways:
        gateway.wait_serving()
    return gateways


def _check(label: str, outcomes: list[Outcome], from_s: float, to_s: float, mesh) -> None:
    rate, counts = _admitted_rate(outcomes, from_s, to_s)
    print(f"{label}: {from_s:.0f}-{to_s:.0f} s admitted {rate:.2f}/s (quota {QUOTA_PER_S:g}/s) {counts}")
    others = [o.result for o in outcomes if from_s <= o.sent_s < to_s and o.result not in ("OK", "QUOTA")]
    assert others == [], f"{label}: {len(others)} failed for other reasons: {others[:3]}\n{mesh.logs()}"
    # Never more than the quota (10%): the property. Less is what gateways starved of CPU give (they sync
    # late: docs/gateway.md, "Quotas across gateways"): on a slower box under the suite's load the store's
    # run admitted 16.0/s of 20. Half the rate still shows the leases flowing.
    assert rate <= 1.1 * QUOTA_PER_S, f"{label}: admitted {rate:.2f}/s, more than the quota, {counts}"
    assert rate >= 0.5 * QUOTA_PER_S, f"{label}: admitted {rate:.2f}/s, {counts}"


@pytest.fixture
def mesh(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("mock-classifier", "--mock-profile", "batch_ms=5")
        yield mesh


PREFIX = "infermesh:quota:"
# Written into the store mid-load: none of it may let the tenant past its quota.
GARBAGE = {
    f"{PREFIX}t:acme:requests": ("set", "garbage"),  # wrong type
    f"{PREFIX}t:acme:tokens": ("hset", {"level": "-5", "ts_ms": "0"}),  # negative
    f"{PREFIX}t:acme:in_flight": ("hset", {"intruder": "999:999:99999999999999"}),  # above the quota
}


def _write(client, key: str, how: tuple) -> None:
    kind, value = how
    client.delete(key)
    if kind == "set":
        client.set(key, value)
    else:
        client.hset(key, mapping=value)


def test_three_gateways_hold_one_quota_through_the_store(tmp_path, mesh):
    """Garbage is also written into the store mid-load (and a foreign tenant's key before the start):
    the rate holds, and the gateways log each bad key."""
    store = ValkeyProcess(tmp_path).start()
    client = valkey.Valkey(host="127.0.0.1", port=store.port)
    try:
        client.set(f"{PREFIX}t:ghost:requests", "1")
        gateways = _start_gateways(mesh, tmp_path, store.address)

        written: list[float] = []

        def on_tick(elapsed_s: float) -> None:
            if elapsed_s >= 3.0 and not written:
                written.append(elapsed_s)
                for key, how in GARBAGE.items():
                    _write(client, key, how)

        outcomes = _offer_load([g.address for g in gateways], duration_s=7.0, on_tick=on_tick)
        _check("with the store (garbage written at 3 s)", outcomes, SETTLE_S, 7.0, mesh)
        logs = "\n".join(g.log_tail(400) for g in gateways)
        for key in GARBAGE:
            assert f"quota store key {key} " in logs, f"{key} not reported:\n{logs}"
        assert all(f"{PREFIX}t:ghost:requests is not a key of any tenant" in g.log_tail(400) for g in gateways)
    finally:
        client.close()
        store.stop()


def test_three_gateways_hold_one_quota_with_the_store_never_started(tmp_path, mesh):
    gateways = _start_gateways(mesh, tmp_path, f"127.0.0.1:{free_port()}")  # nothing listens there
    outcomes = _offer_load([g.address for g in gateways], duration_s=7.0)
    _check("store never started", outcomes, SETTLE_S, 7.0, mesh)
    assert all("unreachable" in g.log_tail(400) for g in gateways)


def test_store_killed_mid_load_then_restarted(tmp_path, mesh):
    store = ValkeyProcess(tmp_path).start()
    try:
        gateways = _start_gateways(mesh, tmp_path, store.address)
        killed_at_s, restarted_at_s, end_s = 5.0, 10.0, 15.0
        events: dict[str, float] = {}

        def on_tick(elapsed_s: float) -> None:
            if elapsed_s >= killed_at_s and "killed" not in events:
                store.kill()
                events["killed"] = elapsed_s
            elif elapsed_s >= restarted_at_s and "restarted" not in events:
                store.start()  # same port, empty: its buckets read as full
                events["restarted"] = elapsed_s

        outcomes = _offer_load([g.address for g in gateways], duration_s=end_s, on_tick=on_tick)
        print(f"store SIGKILLed at {events['killed']:.2f} s, restarted at {events['restarted']:.2f} s")
        _check("store up", outcomes, SETTLE_S, killed_at_s, mesh)
        _check("store down (fallback share)", outcomes, killed_at_s + SETTLE_S, restarted_at_s, mesh)
        _check("store back (re-synced)", outcomes, restarted_at_s + SETTLE_S, end_s, mesh)
        for gateway in gateways:
            log = gateway.log_tail(400)
            assert log.count("unreachable") == 1, log  # one line for the outage, not one per request
            assert "answering" in log, log
    finally:
        store.stop()


IN_FLIGHT_QUOTA = 4
SLOW_BATCH_S = 0.3
# Critical: calls wait up to a whole slow batch in the scheduler's queue, and the gateway would
# shed standard traffic at 0.4 s of queue time; the test is about the quota, not shedding.
IN_FLIGHT_TENANTS = TENANTS.replace("requests_per_s: 20.0", "requests_per_s: 1000").replace(
    "requests_burst: 10", "requests_burst: 1000").replace("max_in_flight: 200", f"max_in_flight: {IN_FLIGHT_QUOTA}").replace(
    "priority: standard", "priority: critical")


def test_in_flight_limit_holds_across_gateways_through_the_store(tmp_path):
    """Every classify takes at least SLOW_BATCH_S, so one slot serves at most window / SLOW_BATCH_S + 1
    requests in a window: IN_FLIGHT_QUOTA slots across all gateways bound what all of them admit.
    Each gateway enforcing the whole limit alone would admit up to three times that."""
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("mock-classifier", "--mock-profile", f"batch_ms={SLOW_BATCH_S * 1000:g}")
        store = ValkeyProcess(tmp_path).start()
        try:
            gateways = _start_gateways(mesh, tmp_path, store.address, IN_FLIGHT_TENANTS)
            stop_s = time.monotonic() + 7.0
            outcomes: list[Outcome] = []
            start_s = time.monotonic()

            def client(gateway: int) -> None:  # closed loop: a refused call is retried after 20 ms
                with session_tls.channel(gateways[gateway].address) as channel:
                    stub = gateway_pb2_grpc.InferenceStub(channel)
                    while time.monotonic() < stop_s:
                        outcome = _classify(stub, gateway, time.monotonic() - start_s)
                        outcomes.append(outcome)
                        if outcome.result != "OK":
                            time.sleep(0.02)

            with ThreadPoolExecutor(max_workers=4 * NUM_GATEWAYS) as pool:
                list(pool.map(client, [g for g in range(NUM_GATEWAYS) for _ in range(4)]))
        finally:
            store.stop()
        window_s = 7.0 - SETTLE_S
        _, counts = _admitted_rate(outcomes, SETTLE_S, 7.0)
        bound = IN_FLIGHT_QUOTA * (window_s / SLOW_BATCH_S + 1)
        # Slot-seconds the admitted calls used, over those the quota offers: low if leases starve gateways.
        used_s = sum(o.duration_s for o in outcomes if o.result == "OK" and SETTLE_S <= o.sent_s < 7.0)
        utilization = used_s / (IN_FLIGHT_QUOTA * window_s)
        print(f"in flight {IN_FLIGHT_QUOTA} across gateways, >= {SLOW_BATCH_S:g} s per call: admitted "
              f"{counts['admitted']} in {window_s:g} s (bound {bound:g}), slot utilization {utilization:.2f} {counts}")
        others = [o.result for o in outcomes if o.result not in ("OK", "QUOTA")]
        assert others == [], f"{len(others)} failed for other reasons: {others[:3]}\n{mesh.logs()}"
        assert counts["admitted"] <= bound
        assert utilization >= 0.6, "slots left unused: the leases starve the gateways"
        # Fair shares of 4 slots over 3 gateways are 2/1/1: none is left with nothing.
        assert min(counts["per_gateway_admitted"]) >= 0.15 * counts["admitted"], counts


TOKENS_PER_S = 90.0
TOKENS_BURST = 40
MAX_TOKENS = 7
TOKEN_TENANTS = TENANTS.replace("requests_per_s: 20.0", "requests_per_s: 1000").replace(
    "requests_burst: 10", "requests_burst: 1000").replace("tokens_per_s: 100000", f"tokens_per_s: {TOKENS_PER_S}").replace(
    "tokens_burst: 100000", f"tokens_burst: {TOKENS_BURST}")


def _quota_kind(details: str) -> str:
    """Which of the tenant's quotas a refusal names (services/gateway/quota/lease.py's messages)."""
    if "token rate quota" in details:
        return "tokens_per_s"
    if "in flight" in details:
        return "max_in_flight"
    return "other"


def _generate(stub, gateway: int, sent_s: float) -> tuple[Outcome, int]:
    request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="mock-generator"), prompt="a",
                                          sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
    try:
        chunks = list(stub.Generate(request, timeout=10, metadata=(("authorization", f"Bearer {API_KEY}"),)))
        usage = chunks[-1].usage
        return Outcome(sent_s, gateway, "OK"), usage.prompt_tokens + usage.completion_tokens
    except grpc.RpcError as exc:
        details = exc.details() or ""
        if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tenant 'acme'" in details:
            return Outcome(sent_s, gateway, f"QUOTA {_quota_kind(details)}"), 0
        return Outcome(sent_s, gateway, f"{exc.code().name}: {details}"), 0


def test_token_rate_holds_across_gateways_through_the_store(tmp_path):
    """Generate streams charged prompt + max_tokens up front and settled to their usage, offered at 3x
    tokens_per_s over three gateways: all of them together never let through more than the shared
    bucket holds (what one gateway alone would), and every stream they did not admit was refused
    by the tenant's quota. How close to the rate they get is printed, not asserted: gateways starved
    of CPU sync late and get less than the rate, never more (docs/gateway.md, "Quotas across
    gateways"); a full-suite run at load ~9 admitted 48 tokens/s of 90, every other stream refused
    by the token quota."""
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("mock-generator", "--mock-profile", "step_ms=5")
        store = ValkeyProcess(tmp_path).start()
        try:
            gateways = _start_gateways(mesh, tmp_path, store.address, TOKEN_TENANTS)
            channels = [session_tls.channel(g.address) for g in gateways]
            stubs = [gateway_pb2_grpc.InferenceStub(c) for c in channels]
            # Charged 1 prompt byte + 1 + 7 up front; the usage of 8 is settled, 1 token refunded.
            duration_s, tokens_per_request = 7.0, 9
            offered_per_s = 3 * TOKENS_PER_S / tokens_per_request
            futures = []
            with ThreadPoolExecutor(max_workers=24) as pool:
                start_s = time.monotonic()
                for index in range(int(duration_s * offered_per_s)):
                    time.sleep(max(0.0, start_s + index / offered_per_s - time.monotonic()))
                    futures.append(pool.submit(_generate, stubs[index % NUM_GATEWAYS], index % NUM_GATEWAYS,
                                               time.monotonic() - start_s))
                results = [f.result() for f in futures]
                elapsed_s = time.monotonic() - start_s  # every admission happened before this
            for channel in channels:
                channel.close()
            # A sync the store ran past its deadline (a CPU-starved gateway or store) counts as the store
            # unreachable: that gateway enforces its fallback share, rate / N, until its next sync.
            num_fell_back = sum("unreachable" in g.log_tail(400) for g in gateways)
        finally:
            store.stop()
    others = [o.result for o, _ in results if o.result != "OK" and not o.result.startswith("QUOTA")]
    assert others == [], f"{len(others)} failed for other reasons: {others[:3]}"
    refusals = Counter(o.result for o, _ in results if o.result.startswith("QUOTA"))
    tokens = sum(n for _, n in results)
    window = [(o, n) for o, n in results if SETTLE_S <= o.sent_s < duration_s]
    window_tokens_per_s = sum(n for _, n in window) / (duration_s - SETTLE_S)
    admitted = [sum(o.result == "OK" and o.gateway == g for o, _ in results) for g in range(NUM_GATEWAYS)]
    # When the load starts the shared bucket holds at most the burst and each gateway a slice of at
    # most the burst (idle: its headroom, burst / live gateways as it last knew them); from then on
    # only the refill comes in, plus the fallback buckets' refill of any gateway that fell back (at
    # most rate / N the whole time). Without the store the three would admit 3 x rate.
    bound = (1 + NUM_GATEWAYS) * TOKENS_BURST + TOKENS_PER_S * elapsed_s * (1 + num_fell_back / NUM_GATEWAYS)
    print(f"tokens across gateways: {tokens} in {elapsed_s:.2f} s (bound {bound:.0f}, {num_fell_back} gateways fell "
          f"back), {window_tokens_per_s:.1f} tokens/s from {SETTLE_S:g} s (quota {TOKENS_PER_S:g}); {len(results)} "
          f"streams offered, admitted per gateway {admitted}, refused {dict(refusals)}, tokens per stream "
          f"{sorted({n for _, n in results if n})}")
    assert tokens <= bound, "the gateways together let through more than the tenant's token bucket holds"
    # The offered load was over the rate: the bound was exercised, and what fell short of the rate
    # was refused by the token quota, with its reason (nothing dropped, nothing refused otherwise).
    assert refusals["QUOTA tokens_per_s"] > 0, f"the token quota never refused: nothing was tested {dict(refusals)}"
    assert refusals["QUOTA other"] == 0, dict(refusals)
