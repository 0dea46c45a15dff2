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

from tools.testbed.mesh_load import LoadShape
from tools.testbed.mesh_replicas import replicated_mesh
from tools.testbed.processes import wait_until

pytestmark = pytest.mark.integration

MODELS = ["toy-classifier", "mock-generator"]
NUM_SCHEDULERS = 2
IN_FLIGHT = "infermesh_gateway_model_in_flight_requests"


def test_sigkill_of_one_gateway_fails_no_call_of_a_client_spread_over_both(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        mesh.add_schedulers(NUM_SCHEDULERS)
        mesh.add_workers(MODELS)
        mesh.add_gateway()
        mesh.add_gateway()
        mesh.wait_spread(MODELS)

        load = mesh.start_load(LoadShape(classify_per_s=60, streams_per_s=4, client_resumes_streams=True))
        load.wait_completed(90, "before the kill")
        victim = mesh.gateways[0]
        # Killed while it holds streams under way, so the committed-stream case is exercised.
        wait_until(lambda: mesh.metric(victim, IN_FLIGHT, model="mock-generator") >= 2, timeout_s=10,
                   message="streams in flight on the victim")
        victim.signal(signal.SIGKILL)
        victim.proc.wait(timeout=10)
        load.wait_completed(150, "after the kill")
        counts = load.stop()
        counts.assert_nothing_lost("gateway SIGKILL", mesh.logs)
        assert mesh.gateways[1].alive()
        assert counts.num_client_resumed_streams >= 1
