"""GenerateRequest.stream out of range: the gateway and the scheduler (both of its paths) refuse it alike."""

from __future__ import annotations

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2_grpc
from tests.support.submit_session import generate_replies
from tools.testbed import session_tls
from tools.testbed.scheduler_fixtures import generate_request

pytestmark = pytest.mark.integration

GENERATOR = common_pb2.ModelRef(name="toy-generator")

BAD = [
    (gateway_pb2.StreamOptions(max_tokens_per_chunk=1025), "stream.max_tokens_per_chunk must be in [0, 1024], got 1025"),
    (gateway_pb2.StreamOptions(interval_ms=5001), "stream.interval_ms must be in [0, 5000], got 5001"),
    (gateway_pb2.StreamOptions(max_tokens_per_chunk=4, interval_ms=4_000_000_000),
     "stream.interval_ms must be in [0, 5000], got 4000000000"),
]


def _status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


@pytest.mark.parametrize(("options", "message"), BAD, ids=["count", "interval", "interval-huge"])
def test_out_of_range_stream_options_are_invalid_argument_at_gateway_and_scheduler(toy_mesh, gateway_stub,
                                                                                   options, message):
    request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc", stream=options,
                                          sampling=common_pb2.SamplingParams(max_tokens=3))
    assert _status_of(lambda: list(gateway_stub.Generate(request, timeout=10))) == (
        grpc.StatusCode.INVALID_ARGUMENT, message)

    upstream = generate_request("abc", 3)
    upstream.request.stream.CopyFrom(options)
    with session_tls.channel(toy_mesh.scheduler.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        assert _status_of(lambda: list(stub.Generate(upstream, timeout=10))) == (
            grpc.StatusCode.INVALID_ARGUMENT, message)
        (reply,) = generate_replies(stub, upstream)
    assert (reply.error.code, reply.error.message) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], message)


def test_the_largest_values_are_served(gateway_stub):
    request = gateway_pb2.GenerateRequest(
        model=GENERATOR, prompt="abc", sampling=common_pb2.SamplingParams(max_tokens=3),
        stream=gateway_pb2.StreamOptions(max_tokens_per_chunk=1024, interval_ms=5000))
    chunks = list(gateway_stub.Generate(request, timeout=10))
    # The first token at once, the other two with the last chunk (neither count nor interval reached).
    assert [list(c.token_ids) for c in chunks] == [[ord("d")], [ord("e"), ord("f")]]
    assert chunks[-1].usage.completion_tokens == 3
