"""Overload at the gateway, with real processes: the adaptive limit refuses before any upstream call
(the scheduler never sees those requests), priority classes are refused in order (sheddable first,
critical last), and a request whose deadline passes while it is queued never reaches a worker.

The worker is the toy classifier taking 800 ms a batch of at most one item, so requests stay in
flight long enough to count them; the gateway's adaptive limit is pinned (min = max) so its shares
are exact: 10 in flight for critical, 9 for standard, 6 for sheddable.
"""

from __future__ import annotations

import time

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT, CLASSIFIER, bearer, scrape, tenant, write_tenants
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = {"critical": "key-critical", "standard": "key-standard", "sheddable": "key-sheddable"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    tenants = write_tenants(tmp / "tenants.yaml", [tenant(p, key, priority=p) for p, key in KEYS.items()])
    ports = {name: free_port() for name in ("gateway", "scheduler", "worker")}
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler("--metrics-port", str(ports["scheduler"]))
        mesh.start_worker("toy-classifier", "--toy-compute-ms", "800", "--max-batch-size", "1",
                          "--metrics-port", str(ports["worker"]))
        mesh.start_gateway("--tenants-file", str(tenants), "--metrics-port", str(ports["gateway"]),
                           "--limit-initial", "10", "--limit-min", "10", "--limit-max", "10",
                           "--shed-in-flight-at", "0.99,1.0", "--shed-queue-slo-ms", "10000,10000,10000")
        mesh.ports = ports
        with session_tls.channel(mesh.gateway.address) as channel:
            mesh.stub = gateway_pb2_grpc.InferenceStub(channel)
            # Served once before any test counts: a worker SERVING may not have attached to the scheduler
            # yet, and calls sent before it does never show as 6 in flight (a fresh-clone suite timed out so).
            wait_until(lambda: refused_code(classify(mesh.stub, "critical")) is None, timeout_s=30,
                       message="a first classify served")
            yield mesh


def classify(stub, priority: str, timeout_s: float = 30.0):
    return stub.Classify.future(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT),
                                timeout=timeout_s, metadata=bearer(KEYS[priority]))


def refused_code(future) -> grpc.StatusCode | None:
    try:
        future.result()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def wait_in_flight(mesh, num: int) -> None:
    try:
        wait_until(lambda: scrape(mesh.ports["gateway"]).value(
            "infermesh_gateway_model_in_flight_requests", model="toy-classifier") == num,
            timeout_s=30, message=f"{num} requests in flight at the gateway")
    except TimeoutError as exc:  # once in a fresh-clone suite, cause unknown: the services' logs say more
        metrics = scrape(mesh.ports["gateway"])
        counts = {name: metrics.value(name) for name in ("infermesh_gateway_held_requests",
                                                         "infermesh_gateway_redispatches_total",
                                                         "infermesh_gateway_refusals_total")}
        raise TimeoutError(f"{exc}; {counts}\n{mesh.logs()}") from exc


def scheduler_requests(mesh) -> float:
    return scrape(mesh.ports["scheduler"]).value("infermesh_scheduler_requests_total", model="toy-classifier")


def test_priority_classes_are_refused_in_order_sheddable_first_critical_last(mesh):
    stub = mesh.stub
    held = [classify(stub, "sheddable") for _ in range(6)]
    wait_in_flight(mesh, 6)
    status = refused_code(classify(stub, "sheddable"))
    assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
    held += [classify(stub, "standard") for _ in range(3)]  # standard may fill 9 of the 10
    wait_in_flight(mesh, 9)
    assert refused_code(classify(stub, "standard")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused_code(classify(stub, "sheddable")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    held.append(classify(stub, "critical"))  # critical may fill all 10
    wait_in_flight(mesh, 10)
    with pytest.raises(grpc.RpcError) as refused:
        classify(stub, "critical").result()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "adaptive limit for critical traffic is 10" in refused.value.details()
    assert dict(refused.value.trailing_metadata())["grpc-retry-pushback-ms"]
    assert all(refused_code(f) is None for f in held), "every admitted request is served"
    metrics = scrape(mesh.ports["gateway"])
    refusals = {p: metrics.value("infermesh_gateway_refusals_total", reason="limit", priority=p) for p in KEYS}
    assert refusals == {"sheddable": 2.0, "standard": 1.0, "critical": 1.0}


def test_refusals_happen_at_the_gateway_and_the_scheduler_never_sees_them(mesh):
    stub = mesh.stub
    wait_in_flight(mesh, 0)
    before_gateway = scrape(mesh.ports["gateway"]).value("infermesh_gateway_refusals_total", reason="limit")
    before_scheduler = scheduler_requests(mesh)
    futures = [classify(stub, "critical") for _ in range(40)]
    codes = [refused_code(f) for f in futures]
    num_ok = codes.count(None)
    num_refused = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert num_ok + num_refused == 40 and num_refused >= 30
    refused_by_limit = scrape(mesh.ports["gateway"]).value("infermesh_gateway_refusals_total", reason="limit")
    assert refused_by_limit - before_gateway == num_refused
    wait_until(lambda: scheduler_requests(mesh) - before_scheduler == num_ok, timeout_s=5,
               message="the scheduler counted the admitted requests")
    assert scheduler_requests(mesh) - before_scheduler == num_ok  # and not one of the refused


def test_a_request_whose_deadline_passes_in_the_queue_never_reaches_a_worker(mesh):
    stub = mesh.stub
    wait_in_flight(mesh, 0)
    items_before = scrape(mesh.ports["worker"]).value("infermesh_worker_batch_size_sum")
    slow = [classify(stub, "critical") for _ in range(2)]  # the worker is busy with these for ~1.6 s
    wait_in_flight(mesh, 2)
    late = [classify(stub, "critical", timeout_s=0.25) for _ in range(4)]
    assert [refused_code(f) for f in late] == [grpc.StatusCode.DEADLINE_EXCEEDED] * 4
    assert all(refused_code(f) is None for f in slow)
    wait_until(lambda: scrape(mesh.ports["worker"]).value("infermesh_worker_batch_size_sum") - items_before >= 2,
               timeout_s=5, message="the worker ran the two slow requests")
    assert scrape(mesh.ports["worker"]).value("infermesh_worker_batch_size_sum") - items_before == 2


def test_the_stages_add_up_to_what_the_client_waited(mesh):
    """Leaf stages cover the gateway's total exactly (overhead is each service's remainder), and
    ingress covers the wait before the handler: together they are the client's whole wait but the
    reply's way back."""
    wait_in_flight(mesh, 0)
    began_s = time.perf_counter()
    sent_us = time.time_ns() // 1000
    reply = mesh.stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=30,
                               metadata=(*bearer(KEYS["critical"]), ("x-request-start", f"t={sent_us}")))
    waited_us = (time.perf_counter() - began_s) * 1e6
    stages = {(common_pb2.Stage.Name(s.stage), s.service): s.duration_us for s in reply.timings.stages}
    aggregates = {("STAGE_GATEWAY", "gateway"), ("STAGE_SCHEDULER", "scheduler"), ("STAGE_INGRESS", "gateway")}
    leaves_us = sum(us for key, us in stages.items() if key not in aggregates)
    assert abs(leaves_us - reply.timings.total_us) <= 10  # rounding of each stage to 1 us
    assert ("STAGE_OVERHEAD", "scheduler") in stages and ("STAGE_NETWORK", "gateway") in stages
    covered_us = leaves_us + stages[("STAGE_INGRESS", "gateway")]
    assert 0.5 * waited_us < covered_us <= waited_us + 1000  # clocks read a few us apart
