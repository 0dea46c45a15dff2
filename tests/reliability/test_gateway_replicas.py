"""SIGKILL one of two gateways under load: a client spread over both loses nothing.

The client is what docs/operations.md tells users to configure: one channel over both
gateway addresses with round_robin and a retryPolicy for UNAVAILABLE, so a call whose
connection died before any reply is retried on the other gateway by gRPC itself. A stream
already under way on the killed gateway is committed (tokens were delivered), so gRPC
cannot retry it: the client re-sends it and checks that the re-sent prefix equals what it
already has (greedy and seeded streams are reproducible), skipping it. Counts printed.
"""

from __future__ import annotations

import signal

import pytest

from tests.support.mesh_load import LoadShape, MeshLoad
from tests.support.mesh_replicas import replicated_mesh
from tests.support.processes import wait_until

pytestmark = pytest.mark.integration

MODELS = ["toy-classifier", "mock-generator"]
NUM_SCHEDULERS = 1


def test_sigkill_of_one_gateway_fails_no_call_of_a_client_spread_over_both(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        mesh.add_schedulers(NUM_SCHEDULERS)
        for model in MODELS:
            mesh.add_worker(model)
            mesh.add_worker(model)
        mesh.add_gateway()
        mesh.add_gateway()
        mesh.wait_spread(MODELS)

        load = MeshLoad(mesh.gateway_target, LoadShape(classify_per_s=60, streams_per_s=4,
                                                        client_resumes_streams=True)).start()
        wait_until(lambda: load.num_done >= 90, timeout_s=30, message="load under way")
        victim = mesh.gateways[0]
        victim.signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        done_at_kill = load.num_done
        wait_until(lambda: load.num_done >= done_at_kill + 150, timeout_s=30,
                   message="calls completing after the kill")
        counts = load.stop()

        print(f"gateway SIGKILL: {counts.summary()}")
        assert counts.problems() == dict.fromkeys(counts.problems(), 0), f"{counts.examples()}\n{mesh.logs()}"
        assert counts.num_classify >= 150 and counts.num_greedy_streams + counts.num_sampled_streams >= 10
        assert mesh.gateways[1].alive()
