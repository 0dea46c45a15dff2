"""A restarted scheduler serves its models within about a second (issue 35), measured on real processes.

Two schedulers, two classifier workers given both. SIGKILL one scheduler: its worker moves to the
other at once, so the survivor holds both. Restart the killed one on its port: it advertises no
model until a worker attaches (ListModels empty, GetPressure without the model: gateways route
nothing there meanwhile), and a worker moves to it at the sub-second cadence the workers keep
while a scheduler is missing (attach_client.UNSETTLED_MAX_S) rather than at the 2.5-7.5 s
rebalance interval, which is what left a restarted scheduler idle for ~7 s.

The test prints the time from the restarted process's start to its first served classify; the
bound it asserts is loose (a shared CI box starts a Python process slowly). Figures: docs/operations.md.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from infermesh.v1 import gateway_pb2
from tools.testbed.processes import ServiceProcess, running_mesh, wait_until
from tools.testbed.scheduler_fixtures import CLASSIFIER, classify_request, pressure_of, scheduler_stub

pytestmark = pytest.mark.integration


def _workers(address: str) -> int:
    try:
        with scheduler_stub(address) as stub:
            pressure = pressure_of(stub, CLASSIFIER)
    except grpc.RpcError:
        return -1
    return pressure.num_workers if pressure is not None else 0


def _served(stub) -> bool:
    try:
        stub.Classify(classify_request("restart-probe"), timeout=1.0)
    except grpc.RpcError:
        return False
    return True


def test_a_restarted_scheduler_gets_a_worker_and_serves_within_seconds_not_a_rebalance_interval(tmp_path):
    with running_mesh(tmp_path) as mesh:
        first = mesh.start_scheduler()
        second = mesh.start_scheduler()
        both = f"{first.address},{second.address}"
        for i in range(2):
            mesh.start_worker("toy-classifier", "--scheduler-address", both, name=f"classifier-{i}")
        wait_until(lambda: (_workers(first.address), _workers(second.address)) == (1, 1), timeout_s=20,
                   message="one worker on each scheduler")

        first.signal(signal.SIGKILL)
        first.proc.wait(timeout=15)
        wait_until(lambda: _workers(second.address) == 2, timeout_s=10, interval_s=0.02,
                   message="both workers on the survivor")

        restarted = ServiceProcess("restarted", "scheduler", first.port, [], dict(mesh.env),
                                   tmp_path / "restarted.log")
        mesh.processes.append(restarted)
        began = time.monotonic()
        restarted.start()
        restarted.wait_serving()
        serving_s = time.monotonic() - began
        with scheduler_stub(restarted.address) as stub:
            models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=2.0).models
            attached_already = _workers(restarted.address) > 0
            assert attached_already or not models, "no model advertised before a worker attached"
            wait_until(lambda: _served(stub), timeout_s=20, interval_s=0.02, message="a classify served")
        served_s = time.monotonic() - began
        assert (_workers(restarted.address), _workers(second.address)) == (1, 1)
    print(f"restarted scheduler: SERVING {serving_s:.2f} s after its start, first classify served "
          f"{served_s:.2f} s after its start ({served_s - serving_s:.2f} s after SERVING)")
    # Issue 35's target is 1 s from SERVING; the bound leaves room for a loaded CI box. Before the
    # change, the move waited for a rebalance check 2.5-7.5 s apart, half the time a second one.
    assert served_s - serving_s < 4.0
