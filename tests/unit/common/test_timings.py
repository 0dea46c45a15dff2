"""Stage timings on the wire: what a newer peer's stages do to an older reader."""

from __future__ import annotations

from infermesh.v1 import common_pb2
from services.common.timings import StageTime, from_proto, to_proto


def test_stages_round_trip():
    stages = [StageTime("compute", 1200, "worker"), StageTime("postprocess", 30, "worker")]
    assert from_proto(to_proto(stages, total_us=1230)) == stages


def test_a_stage_this_build_does_not_know_is_left_out_not_a_crash():
    timings = to_proto([StageTime("compute", 1200, "worker")])
    timings.stages.add(stage=99, duration_us=5, service="worker")  # a newer peer's stage (open enum)
    timings.stages.add(stage=common_pb2.STAGE_UNSPECIFIED, duration_us=7, service="worker")
    parsed = common_pb2.Timings.FromString(timings.SerializeToString())
    assert from_proto(parsed) == [StageTime("compute", 1200, "worker")]
