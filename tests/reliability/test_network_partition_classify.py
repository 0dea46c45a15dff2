"""Classify calls on a scheduler cut off the network are re-sent to the other within their deadline.

The deadline (3 s) is shorter than the cut (CUT_S), so waiting for the link to return is not
enough: the gateway must notice the silent scheduler and send its calls elsewhere, and calls
stuck there must not keep the model's concurrency limit full for the healthy one.
"""

from __future__ import annotations

import pytest

from tools.testbed.mesh_load import LoadShape
from tools.testbed.mesh_replicas import PARTITION_STREAMS, cut_scheduler_under_load

pytestmark = pytest.mark.integration


def test_classify_calls_on_a_scheduler_cut_off_the_network_are_re_sent_within_their_deadline(tmp_path, network):
    shape = LoadShape(classify_per_s=50, streams_per_s=4, classify_deadline_s=3.0, stream_deadline_s=40.0,
                      streams=PARTITION_STREAMS)
    cut_scheduler_under_load(tmp_path, network, "toy-classifier", shape)

