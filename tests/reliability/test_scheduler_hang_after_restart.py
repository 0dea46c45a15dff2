"""A scheduler hangs (SIGSTOP) right after the other was killed and restarted: no call is lost (issue 35).

The hidden chaos run that lost 378 of 3930 classify calls: scheduler 1 SIGKILLed and restarted,
then scheduler 2 frozen while its calls were in flight. The gateway's silence watch severs the
frozen scheduler's calls; each idempotent classify is re-dispatched (failed over to the restarted
scheduler, or in regroup rounds while that one's workers re-attach) as long as its deadline
allows, and streams are resumed. The classify deadline (3 s) is shorter than the hang, so
waiting the hang out is not enough. Counts and the re-dispatched calls are printed.
"""

from __future__ import annotations

import signal
import time

import pytest

from tools.testbed.mesh_load import LoadShape
from tools.testbed.mesh_replicas import MODELS, kill, replicated_mesh, start_spread_mesh

pytestmark = pytest.mark.integration

HANG_S = 4.0
SHAPE = LoadShape(classify_per_s=60, streams_per_s=3, classify_deadline_s=3.0, stream_deadline_s=40.0)


def test_a_scheduler_hung_right_after_the_other_restarted_loses_no_call(tmp_path):
    with replicated_mesh(tmp_path) as mesh:
        start_spread_mesh(mesh)
        load = mesh.start_load(SHAPE)
        load.wait_completed(60, "before the faults")
        # Restart the scheduler that classify does not prefer, then freeze the one it does, with
        # calls in flight: they are severed and must go to the one that was just restarted.
        serving = mesh.scheduler_serving("toy-classifier")
        victim = next(s for s in mesh.schedulers if s is not serving)
        kill(victim, load)
        mesh.restart(victim)
        mesh.wait_spread(MODELS)  # the restarted scheduler has a worker of each model again
        hung = serving
        hung.signal(signal.SIGSTOP)
        try:
            time.sleep(HANG_S)  # the fault lasts this long whatever happens meanwhile
        finally:
            hung.signal(signal.SIGCONT)
        load.wait_completed(60, "after the hang")
        counts = load.stop()
        gateway = mesh.gateways[0]
        redispatched = mesh.metric(gateway, "infermesh_gateway_redispatches_total")
        print(f"re-dispatched off the hung scheduler: {redispatched:g}")
        assert redispatched > 0, "calls were in flight on the frozen scheduler: nothing was tested"
        mesh.gateway_failovers()
        counts.assert_nothing_lost(f"SIGKILL + restart of {victim.name}, then SIGSTOP of {hung.name} for "
                                   f"{HANG_S:g} s", mesh.logs)
