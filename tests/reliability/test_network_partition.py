"""A scheduler cut off the network under load, then reconnected: nothing lost, nothing delivered twice.

Each role runs as a host in its own network namespace on one switch (tools/testbed/netns.py,
the `network` fixture in conftest.py):

    s1, s2: a scheduler each      gw: the gateway      wk: the workers (two per model)

Mid-load the link of the scheduler serving a model goes down for a few seconds (CUT_S). Unlike a
kill, it and its connections stay alive: nothing is reset, packets just stop. Streams caught
there are resumed on the other scheduler from the tokens delivered; when the link comes back
the cut-off scheduler may still hold them and send their next chunks, which the client must
never see (a repeated index or a second final chunk counts as a failure). Long streams
(longer than the cut) are in the mix so that some are still running when it returns.
"""

from __future__ import annotations

import pytest

from tools.testbed.mesh_load import LoadShape
from tools.testbed.mesh_replicas import PARTITION_STREAMS, cut_scheduler_under_load

pytestmark = pytest.mark.integration

def test_streams_on_a_scheduler_cut_off_the_network_are_resumed_once(tmp_path, network):
    shape = LoadShape(classify_per_s=0, streams_per_s=4, stream_deadline_s=40.0, streams=PARTITION_STREAMS)
    cut_scheduler_under_load(tmp_path, network, "mock-generator", shape)
