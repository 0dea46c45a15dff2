"""Two schedulers under load: SIGKILL one and restart it; nothing is lost.

Both schedulers serve both models; the two workers of each model spread over them and the
gateway is given both addresses. Classify calls caught on the dead scheduler are re-sent
to the other within their deadline; streams cut mid-way are resumed by the gateway as
continuations (tokens already delivered), so the client sees one unbroken stream: indices
continue, the text equals the unbroken reference (greedy and seeded sampling). Counts printed.
"""

from __future__ import annotations

import signal

import pytest

from tests.support.mesh_load import LoadShape, MeshLoad
from tests.support.mesh_replicas import ReplicatedMesh, replicated_mesh
from tests.support.processes import ServiceProcess

pytestmark = pytest.mark.integration

MODELS = ["toy-classifier", "mock-generator"]
SHAPE = LoadShape(classify_per_s=60, streams_per_s=4)


def start_spread_mesh(mesh: ReplicatedMesh) -> None:
    """Two schedulers, one gateway, two workers per model with one of each on each scheduler."""
    mesh.add_schedulers(2)
    for model in MODELS:
        mesh.add_worker(model)
        mesh.add_worker(model)
    mesh.add_gateway()
    mesh.wait_spread(MODELS)


def kill_and_restart(mesh: ReplicatedMesh, victim: ServiceProcess, load: MeshLoad) -> None:
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    load.wait_completed(150, f"after the SIGKILL of {victim.name}")
    mesh.restart(victim)
    mesh.wait_attached(MODELS, 2)
    load.wait_completed(60, f"after the restart of {victim.name}")


@pytest.mark.parametrize("model", MODELS)
def test_sigkill_of_the_scheduler_serving_a_model_and_its_restart_lose_no_call(tmp_path, model):
    """The gateway prefers one scheduler per model (rendezvous affinity): kill the one serving `model`."""
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh)
        load = MeshLoad(mesh.gateway_target, SHAPE).start()
        load.wait_completed(90, "before the kill")
        victim = mesh.scheduler_serving(model)
        serves_streams = victim is mesh.scheduler_serving("mock-generator")
        kill_and_restart(mesh, victim, load)
        load.stop().assert_nothing_lost(f"SIGKILL + restart of the scheduler serving {model}", mesh.logs)
        gateway = mesh.gateways[0]
        resumed = mesh.metric(gateway, "infermesh_gateway_stream_resumes_total")
        failed_over = mesh.metric(gateway, "infermesh_gateway_failovers_total")
        print(f"gateway: {resumed:g} streams resumed, {failed_over:g} calls failed over")
        if serves_streams:
            assert resumed >= 1, "streams were under way on the killed scheduler: they must have been resumed"
