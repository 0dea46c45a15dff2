"""A restarted scheduler serves its models within about a second (issue 35), measured on real processes.

Two schedulers and the case make chaos found slow: ONE classifier worker, given both. It is attached to
both (services/worker/attach_every.py). SIGKILL one scheduler: the worker keeps serving the other and
re-dials the lost one with its short capped backoff (0.05 .. 0.5 s, full jitter). Restart the killed
one on its port: it advertises no model until the worker attaches (ListModels empty: gateways route
nothing there meanwhile), then serves. Before, a worker held one stream and moved to an empty
scheduler only off one with two workers of its model more, so with one worker left the restarted
scheduler served nothing until another worker came (4.5-6.1 s in make chaos).

The test prints the time from the restarted process's start, and from its SERVING, to its first
served classify (figures: docs/operations.md); it asserts behaviour, not speed.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from infermesh.v1 import gateway_pb2
from tools.testbed.gateway_fixtures import restart_on_same_port
from tools.testbed.processes import running_mesh, wait_until
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


def test_a_restarted_scheduler_is_served_by_the_one_worker_left_that_serves_the_other_too(tmp_path):
    with running_mesh(tmp_path) as mesh:
        first = mesh.start_scheduler()
        second = mesh.start_scheduler()
        mesh.start_worker("toy-classifier", "--scheduler-address", f"{first.address},{second.address}",
                          name="classifier")
        wait_until(lambda: (_workers(first.address), _workers(second.address)) == (1, 1), timeout_s=20,
                   message="the worker attached to both schedulers")

        first.signal(signal.SIGKILL)
        first.proc.wait(timeout=15)
        with scheduler_stub(second.address) as stub:
            assert _served(stub), "the other scheduler keeps its worker"

        began = time.monotonic()
        restarted = restart_on_same_port(mesh, first, "restarted")  # started, then SERVING
        serving_s = time.monotonic() - began
        with scheduler_stub(restarted.address) as stub:
            models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=2.0).models
            attached_already = _workers(restarted.address) > 0
            assert attached_already or not models, "no model advertised before a worker attached"
            wait_until(lambda: _served(stub), timeout_s=10, interval_s=0.02, message="a classify served")
        served_s = time.monotonic() - began
        assert (_workers(restarted.address), _workers(second.address)) == (1, 1)
    print(f"restarted scheduler: SERVING {serving_s:.2f} s after its start, first classify served "
          f"{served_s:.2f} s after its start ({served_s - serving_s:.2f} s after SERVING)")
