"""Two schedulers under load: SIGKILL one and restart it; nothing is lost.

Both schedulers serve both models; the two workers of each model spread over them and the
two gateways are given both addresses. Classify calls caught on the dead scheduler are re-sent
to the other within their deadline; streams cut mid-way are resumed by the gateway as
continuations (tokens already delivered), so the client sees one unbroken stream: indices
continue, the text equals the unbroken reference (greedy and seeded sampling). Counts printed.
"""

from __future__ import annotations

import pytest

from tools.testbed.mesh_replicas import MODELS, SHAPE, kill_and_restart, replicated_mesh, start_spread_mesh

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("model", MODELS)
def test_sigkill_of_the_scheduler_serving_a_model_and_its_restart_under_load_lose_no_call(tmp_path, model):
    """Every gateway prefers the same scheduler per model (rendezvous affinity): kill the one serving `model`.

    Two gateways, the client spread over both: each must fail its own calls over. The killed
    scheduler is restarted while the load goes on: calls reaching it before its workers do
    must not fail either.
    """
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh, num_gateways=2)
        load = mesh.start_load(SHAPE)
        load.wait_completed(90, "before the kill")
        victim = mesh.scheduler_serving(model)
        serves_streams = victim is mesh.scheduler_serving("mock-generator")
        kill_and_restart(mesh, victim, load)
        load.stop().assert_nothing_lost(f"SIGKILL + restart of the scheduler serving {model}", mesh.logs)
        resumed, _ = mesh.gateway_failovers()
        if serves_streams:
            assert resumed >= 1, "streams were under way on the killed scheduler: they must have been resumed"
