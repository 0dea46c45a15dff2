"""A scheduler going while the other was just restarted: nothing lost.

The SIGKILL of the scheduler holding every worker and call while the other has just been
restarted (as after any earlier kill), and a SIGTERM roll of both, one after the other.

In the roll each scheduler drains in turn (new calls refused with pushback 0 and sent to the other at
once, classify in flight finished, streams still running after the drain grace handed
over and resumed by the gateway on the other) and is restarted on its port before the next
one goes. The second roll is the hard one: it finds the first scheduler freshly restarted,
so the workers must reach it before the calls refused by the draining one run out of time.

The rolling SIGTERM lost 1-3 classify calls in 4 of 9 runs until the gateway waited out regroup
rounds in which no endpoint could be called (the restarted scheduler's breaker open while its
channel reconnected, the other one exited) instead of answering UNAVAILABLE with "retry at once",
and until that hint went out as 1 ms: gRPC's own client retries wait for the deadline on a "0".
"""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from tools.testbed.mesh_load import MeshLoad
from tools.testbed.mesh_replicas import (
    MODELS,
    SHAPE,
    ReplicatedMesh,
    kill_and_restart,
    replicated_mesh,
    start_spread_mesh,
)
from tools.testbed.processes import ServiceProcess

pytestmark = pytest.mark.integration


def _roll(mesh: ReplicatedMesh, scheduler: ServiceProcess, load: MeshLoad) -> None:
    scheduler.signal(signal.SIGTERM)
    assert scheduler.proc.wait(timeout=30) == 0, scheduler.log_tail()
    load.wait_completed(60, f"with {scheduler.name} gone")
    mesh.restart(scheduler)
    mesh.wait_attached(MODELS, 2)


def test_a_rolling_sigterm_of_both_schedulers_loses_no_call(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh)
        # Without gRPC's own client retries: the gateway alone must keep every call.
        load = mesh.start_load(replace(SHAPE, client_retries=False))
        load.wait_completed(90, "before the roll")
        for index in range(len(mesh.schedulers)):
            _roll(mesh, mesh.schedulers[index], load)
        load.wait_completed(60, "after the roll")
        load.stop().assert_nothing_lost("SIGTERM roll of both schedulers", mesh.logs)


def test_sigkill_of_the_scheduler_holding_every_worker_next_to_a_restarted_one_loses_no_call(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh)
        first = mesh.schedulers[0]
        first.signal(signal.SIGKILL)
        first.proc.wait(timeout=10)
        mesh.restart(first)
        mesh.wait_attached(MODELS, 2)  # all on the other one now
        load = mesh.start_load(SHAPE)
        load.wait_completed(90, "before the kill")
        kill_and_restart(mesh, mesh.scheduler_serving("mock-generator"), load)
        load.stop().assert_nothing_lost("SIGKILL of the scheduler holding every worker", mesh.logs)
