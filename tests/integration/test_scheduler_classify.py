"""Classify at the scheduler's own RPC with a TenantContext, real processes: tenant fairness,
deadline expiry in the queue and early rejection, pressure.

Two versions of the toy classifier: v1 runs batches of up to 4 in 30 ms; v2 runs one item
per 800 ms, slow enough to hold requests in its queue. The scheduler keeps 200 ms of each
deadline for itself, so its own deadline handling, not the client's, answers first.
"""

from __future__ import annotations

import statistics
import threading
import time

import grpc
import pytest

from infermesh.v1 import common_pb2
from tools.testbed.processes import running_mesh, wait_until
from tools.testbed.scheduler_fixtures import (
    classify_request,
    pressure_of,
    scheduler_stub,
    wait_for_workers,
)

pytestmark = pytest.mark.integration

SLOW = common_pb2.ModelRef(name="toy-classifier", version="2")
FAST = common_pb2.ModelRef(name="toy-classifier", version="1")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(tmp_path_factory.mktemp("scheduler-classify")) as mesh:
        mesh.start_scheduler("--deadline-margin-ms", "200", "--max-queue-delay-ms", "2")
        mesh.start_worker("toy-classifier", "--toy-compute-ms", "30", "--max-batch-size", "4")
        mesh.start_worker("toy-classifier", "--model-version", "2", "--toy-compute-ms", "800",
                          "--max-batch-size", "1")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, FAST, 1)
            wait_for_workers(stub, SLOW, 1)
        yield mesh


@pytest.fixture
def stub(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        yield stub


def _request(model: common_pb2.ModelRef, who: str):
    request = classify_request(who)
    request.request.model.CopyFrom(model)
    return request


class _ClosedLoopFlood:
    """`concurrency` requests of one tenant always outstanding, each re-sent as soon as it answers."""

    def __init__(self, stub, who: str, concurrency: int) -> None:
        self._stub = stub
        self._request = _request(FAST, who)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._outstanding = 0
        self.latencies_s: list[float] = []
        self.num_errors = 0
        for _ in range(concurrency):
            self._send()

    def _send(self) -> None:
        if self._stop.is_set():
            return
        with self._lock:
            self._outstanding += 1
        sent = time.monotonic()
        future = self._stub.Classify.future(self._request, timeout=10)
        future.add_done_callback(lambda f: self._done(f, sent))

    def _done(self, future, sent: float) -> None:
        with self._lock:
            self._outstanding -= 1
            if future.exception() is None:
                self.latencies_s.append(time.monotonic() - sent)
            else:
                self.num_errors += 1
        self._send()

    def stop(self) -> None:
        self._stop.set()
        wait_until(lambda: self._outstanding == 0, timeout_s=15, message="flood drained")


def test_a_flooding_tenant_barely_delays_a_light_one(stub):
    flood = _ClosedLoopFlood(stub, "heavy", concurrency=48)
    try:
        wait_until(lambda: len(flood.latencies_s) >= 48, timeout_s=10, message="flood under way")
        pressure = pressure_of(stub, FAST)
        light_s = []
        for _ in range(15):
            began = time.monotonic()
            reply = stub.Classify(_request(FAST, "light"), timeout=10)
            light_s.append(time.monotonic() - began)
            assert reply.response.labels[0].label == "bright"
            time.sleep(0.02)
        heavy_s = list(flood.latencies_s[48:])
    finally:
        flood.stop()
    assert flood.num_errors == 0
    # 48 heavy requests queue ahead in FIFO terms (12 batches, ~360 ms); round robin lets light
    # into the next batch: it waits for at most the running and the prefetched batch.
    assert statistics.median(light_s) * 3 < statistics.median(heavy_s), (light_s, statistics.median(heavy_s))
    assert pressure.queue_depth > 0
    est_us = pressure.est_queue_time_us
    assert est_us[common_pb2.PRIORITY_STANDARD] > est_us[common_pb2.PRIORITY_CRITICAL] >= 0


def test_deadline_expires_in_the_queue_and_later_ones_are_refused_up_front(stub):
    # Nothing measured yet: the batcher assumes 50 ms batches, so it accepts a request that will in
    # fact wait 800 ms behind two others, and must drop it from the queue when its deadline passes.
    first = stub.Classify.future(_request(SLOW, "a"), timeout=10)
    second = stub.Classify.future(_request(SLOW, "a"), timeout=10)
    wait_until(lambda: pressure_of(stub, SLOW).queue_depth == 0, timeout_s=5, message="both dispatched")
    time.sleep(0.15)
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(_request(SLOW, "b"), timeout=0.4)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.details().startswith("deadline passed after ")
    assert time.monotonic() - began < 0.35

    # Either may have arrived first; once one is done, one 800 ms batch is measured and the other runs.
    wait_until(lambda: first.done() or second.done(), timeout_s=5, message="one slow batch done")
    began = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Classify(_request(SLOW, "b"), timeout=1.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert caught.value.details().startswith("cannot finish in time")
    assert time.monotonic() - began < 0.2, "refused before any work, not after waiting"
    assert first.result().response.labels and second.result().response.labels
