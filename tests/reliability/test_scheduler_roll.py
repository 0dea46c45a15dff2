"""Schedulers restarted under load, and the other one going while one was just restarted: nothing lost.

A SIGKILLed scheduler restarted while the load goes on; the SIGKILL of the scheduler holding
every worker and call while the other has just been restarted (as after any earlier kill);
and a SIGTERM roll of both, one after the other.

In the roll each scheduler drains in turn (new calls refused with pushback 0 and sent to the other at
once, classify in flight finished, streams still running after the drain grace handed
over and resumed by the gateway on the other) and is restarted on its port before the next
one goes. The second roll is the hard one: it finds the first scheduler freshly restarted,
so the workers must reach it before the calls refused by the draining one run out of time.

These fail today (see each marker's reason); they are kept, not run, until the services
change: `pytest --runxfail tests/reliability/test_scheduler_roll.py` shows the failures.
"""

from __future__ import annotations

import signal

import pytest

from tests.support.mesh_load import MeshLoad
from tests.support.mesh_replicas import (
    MODELS,
    SHAPE,
    ReplicatedMesh,
    kill_and_restart,
    replicated_mesh,
    start_spread_mesh,
)
from tests.support.processes import ServiceProcess

pytestmark = pytest.mark.integration


def _roll(mesh: ReplicatedMesh, scheduler: ServiceProcess, load: MeshLoad) -> None:
    scheduler.signal(signal.SIGTERM)
    assert scheduler.proc.wait(timeout=30) == 0, scheduler.log_tail()
    load.wait_completed(60, f"with {scheduler.name} gone")
    mesh.restart(scheduler)
    mesh.wait_attached(MODELS, 2)


@pytest.mark.xfail(run=False, reason=(
    "7 of 7 runs failed; the last: 1 classify + 4 streams NOT_FOUND 'not served here' (107-425 classify and "
    "7-28 streams before the drain's early re-dial and worker rebalancing): a call reaching the freshly "
    "restarted scheduler before its workers gets NOT_FOUND, and the gateway does not send it to the other"))
def test_a_rolling_sigterm_of_both_schedulers_loses_no_call(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh)
        load = mesh.start_load(SHAPE)
        load.wait_completed(90, "before the roll")
        for index in range(len(mesh.schedulers)):
            _roll(mesh, mesh.schedulers[index], load)
        load.wait_completed(60, "after the roll")
        load.stop().assert_nothing_lost("SIGTERM roll of both schedulers", mesh.logs)


@pytest.mark.xfail(run=False, reason=(
    "4 of 4 runs failed; the last: 7 streams UNAVAILABLE (classify 0; 23-181 classify before): after the kill "
    "the model's candidates are only the dead scheduler (the restarted one had no worker at its last poll), "
    "its breaker is open, so a resume finds no endpoint and the stream ends with the upstream UNAVAILABLE"))
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


@pytest.mark.xfail(run=False, reason=(
    "intermittent, about 1 run in 8: 19 classify + 1 stream NOT_FOUND 'not served here' in the 0.5 s after "
    "the restarted scheduler listens, before the gateway's next ListModels poll (membership keeps its old "
    "ready models, affinity prefers it, NOT_FOUND is not failed over)"))
@pytest.mark.parametrize("model", MODELS)
def test_a_scheduler_restarted_under_load_after_a_sigkill_fails_no_call(tmp_path, model):
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh)
        load = mesh.start_load(SHAPE)
        load.wait_completed(90, "before the kill")
        kill_and_restart(mesh, mesh.scheduler_serving(model), load)
        load.stop().assert_nothing_lost(f"SIGKILL + restart of the scheduler serving {model}", mesh.logs)
