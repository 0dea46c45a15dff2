"""The scheduler dies under load and comes back: retries stay within the budget, the breaker fails
calls fast while open, and both gateways recover when a scheduler returns on the same port.

Two gateways share the mesh and see the same outage:
  * "budget": breaker effectively off, so every request tries the dead scheduler and the retry
    budget alone caps the retries (window 60 s, floor 0.1 retry/s: at most 6 + 10% of requests);
  * "breaker": opens after 5 failures in a row, fails calls without trying for 1 s, then probes.
Neither holds calls while no scheduler can take them (--hold-max-calls 0; the hold has its own
test, tests/reliability/test_all_schedulers_unavailable.py): the budget and the breaker are seen alone.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT, CLASSIFIER, restart_on_same_port, scrape, spawn_gateway
from tools.testbed.processes import free_port, running_mesh, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BUDGET_WINDOW_S = 60
BUDGET_FLOOR_PER_S = 0.1
BUDGET_RATIO = 0.1


@dataclass(frozen=True)
class Outcome:
    sent_s: float
    latency_s: float
    code: grpc.StatusCode
    message: str


class ClosedLoop:
    """One client thread calling Classify back to back (10 ms apart) until stopped."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ClosedLoop:
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.outcomes

    def ok_since(self, since_s: float) -> int:
        return sum(1 for o in list(self.outcomes) if o.sent_s >= since_s and o.code == grpc.StatusCode.OK)

    def _run(self) -> None:
        with session_tls.channel(self.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            request = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT)
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    stub.Classify(request, timeout=2)
                    code, message = grpc.StatusCode.OK, ""
                except grpc.RpcError as exc:
                    code, message = exc.code(), exc.details()
                self.outcomes.append(Outcome(began, time.monotonic() - began, code, message))
                self._stop.wait(0.01)


def test_scheduler_outage_retries_capped_by_budget_breaker_fails_fast_and_mesh_recovers(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier", "--toy-compute-ms", "5")
        budget_port, breaker_port = free_port(), free_port()
        budget_gw = spawn_gateway(
            mesh, "gateway-budget",
            "--breaker-consecutive-failures", "1000000", "--breaker-min-calls", "1000000",
            "--retry-budget-window-s", str(BUDGET_WINDOW_S), "--retry-budget-min-per-s", str(BUDGET_FLOOR_PER_S),
            "--retry-budget-ratio", str(BUDGET_RATIO), "--pressure-poll-interval-ms", "200", "--hold-max-calls", "0",
            metrics_port=budget_port,
        )
        breaker_gw = spawn_gateway(
            mesh, "gateway-breaker",
            "--breaker-consecutive-failures", "5", "--breaker-open-cooldown-ms", "1000",
            "--pressure-poll-interval-ms", "200", "--hold-max-calls", "0",
            metrics_port=breaker_port,
        )
        budget_load, breaker_load = ClosedLoop(budget_gw.address).start(), ClosedLoop(breaker_gw.address).start()
        try:
            wait_until(lambda: budget_load.ok_since(0) >= 20 and breaker_load.ok_since(0) >= 20, timeout_s=20,
                       message="both gateways serve")

            mesh.scheduler.signal(signal.SIGKILL)
            mesh.scheduler.proc.wait(timeout=5)
            killed_s = time.monotonic()
            wait_until(lambda: scrape(breaker_port).value("infermesh_gateway_breaker_state") == 2, timeout_s=5,
                       message="breaker open")
            time.sleep(2.0)  # an outage long enough to exhaust the budget
            breaker_during_outage = scrape(breaker_port)

            restarted_s = time.monotonic()
            restart_on_same_port(mesh, mesh.scheduler, "scheduler-restarted")
            wait_until(lambda: budget_load.ok_since(restarted_s) >= 5 and breaker_load.ok_since(restarted_s) >= 5,
                       timeout_s=20, message="both gateways serve again after the scheduler returned")
        finally:
            budget_outcomes, breaker_outcomes = budget_load.stop(), breaker_load.stop()
        budget_metrics, breaker_metrics = scrape(budget_port), scrape(breaker_port)

    # -- the budget caps retries: counted from the gateway's own metrics ----------------------
    num_requests = budget_metrics.value("infermesh_gateway_requests_total")
    num_retries = budget_metrics.value("infermesh_gateway_retries_total", verdict="retry")
    num_denied = budget_metrics.value("infermesh_gateway_retries_total", verdict="budget_exhausted")
    failed = [o for o in budget_outcomes if killed_s <= o.sent_s < restarted_s and o.code != grpc.StatusCode.OK]
    assert num_requests == len(budget_outcomes)
    assert len(failed) >= 20, "the outage was seen"
    assert {o.code for o in failed} == {grpc.StatusCode.UNAVAILABLE}
    assert num_retries >= 1
    assert num_retries <= BUDGET_FLOOR_PER_S * BUDGET_WINDOW_S + BUDGET_RATIO * num_requests + 1, (
        f"{num_retries} retries for {num_requests} requests"
    )
    assert num_denied >= len(failed) / 2, "most failed requests wanted a retry the budget refused"
    assert budget_metrics.value("infermesh_gateway_retry_budget_remaining") < 1 + BUDGET_RATIO * num_requests

    # -- the open breaker fails calls fast, without touching the scheduler --------------------
    fast_failed = [o for o in breaker_outcomes if o.message.startswith("no scheduler available for model")]
    assert len(fast_failed) >= 10, "calls arrived while the breaker was open"
    assert all(o.code == grpc.StatusCode.UNAVAILABLE for o in fast_failed)
    assert fast_failed[0].message == (
        "no scheduler available for model 'toy-classifier': circuit open for all 1 endpoints"
    )
    assert statistics.median(o.latency_s for o in fast_failed) < 0.05
    # Open (2) or half-open (1) during the outage, never closed: the gauge is set at each 1 s poll and the
    # cool-down is 1 s, so a poll can land after the cool-down ended and before the next probe re-opened it
    # (seen once on a loaded box).
    assert breaker_during_outage.value("infermesh_gateway_breaker_state") in (1, 2)
    # While open, requests fail without an attempt, so the scheduler saw at most the few that tripped
    # it plus one probe per cool-down.
    assert breaker_during_outage.value("infermesh_gateway_retries_total", verdict="retry") <= 20

    # -- recovery ---------------------------------------------------------------------------
    assert breaker_metrics.value("infermesh_gateway_breaker_state") == 0, "closed again after a good probe"
    assert budget_outcomes[-1].code == grpc.StatusCode.OK and breaker_outcomes[-1].code == grpc.StatusCode.OK
