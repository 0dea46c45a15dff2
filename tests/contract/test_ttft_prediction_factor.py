"""ScheduleGenerateRequest.ttft_prediction_factor at the scheduler: one that is no multiplier is INVALID_ARGUMENT on
both of its Generate paths (the stream and the submit session); a valid one is served."""

from __future__ import annotations

import math

import grpc
import pytest

from infermesh.v1 import scheduler_pb2_grpc
from tests.support.submit_session import generate_replies
from tools.testbed import session_tls
from tools.testbed.scheduler_fixtures import generate_request

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("factor", [-1.0, math.nan, math.inf])
def test_a_factor_that_is_no_multiplier_is_invalid_on_both_paths(toy_mesh, factor):
    upstream = generate_request("abc", 3)
    upstream.request.objectives.ttft_ms = 5000
    upstream.ttft_prediction_factor = factor
    message = f"ttft_prediction_factor must be a finite number >= 0 (0: 1), got {factor}"
    with session_tls.channel(toy_mesh.scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(upstream, timeout=10))
        assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        (reply,) = generate_replies(stub, upstream)
    assert (reply.error.code, reply.error.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message)


def test_a_valid_factor_is_served(toy_mesh):
    upstream = generate_request("abc", 3)
    upstream.request.objectives.ttft_ms = 5000
    upstream.ttft_prediction_factor = 0.5
    with session_tls.channel(toy_mesh.scheduler.address) as channel:
        chunks = list(scheduler_pb2_grpc.SchedulerStub(channel).Generate(upstream, timeout=10))
    assert sum(len(c.chunk.token_ids) for c in chunks) == 3
