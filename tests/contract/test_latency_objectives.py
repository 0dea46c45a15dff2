"""Latency objectives at the gateway's gRPC edge: out-of-bounds targets are INVALID_ARGUMENT naming the bound, a
target below one step alone FAILED_PRECONDITION at once."""

from __future__ import annotations

import time

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.integration

GENERATOR = common_pb2.ModelRef(name="toy-generator")
SAMPLING = common_pb2.SamplingParams(max_tokens=2)


def _generate(stub, objectives=None, metadata=()):
    request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="hi", sampling=SAMPLING, objectives=objectives)
    return list(stub.Generate(request, timeout=10, metadata=metadata))


@pytest.mark.parametrize(("objectives", "metadata", "message"), [
    (gateway_pb2.LatencyObjectives(ttft_ms=5), (),
     "latency objective out of bounds: TTFT target 5 ms is below the minimum 10 ms"),
    (gateway_pb2.LatencyObjectives(tpot_ms=90_000), (),
     "latency objective out of bounds: TPOT target 90000 ms is above the maximum 60000 ms"),
    (None, (("x-infermesh-ttft-ms", "900000"),),
     "latency objective out of bounds: TTFT target 900000 ms is above the maximum 600000 ms"),
    (None, (("x-infermesh-tpot-ms", "fast"),),
     "x-infermesh-tpot-ms must be a positive number of milliseconds, got 'fast'"),
])
def test_an_objective_out_of_bounds_is_invalid_argument_naming_the_bound(gateway_stub, objectives, metadata, message):
    with pytest.raises(grpc.RpcError) as caught:
        _generate(gateway_stub, objectives, metadata)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_objectives_within_the_bounds_are_served(gateway_stub):
    chunks = _generate(gateway_stub, gateway_pb2.LatencyObjectives(ttft_ms=5000, tpot_ms=1000),
                       (("x-infermesh-ttft-ms", "20000"),))
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


def test_a_tpot_target_below_one_step_alone_is_failed_precondition_at_once(gateway_stub):
    # Within the bounds (1 ms) but below any step: the gateway refuses it once it has heard the step
    # time, the scheduler before that; either way at once, naming both times.
    with pytest.raises(grpc.RpcError) as caught:
        _generate(gateway_stub, gateway_pb2.LatencyObjectives(ttft_ms=5000, tpot_ms=1))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details().startswith("TPOT target 1 ms cannot be met by model ")
    assert "one step alone takes " in caught.value.details()


def test_a_stream_sent_longer_ago_than_its_ttft_target_is_refused_once_the_gateway_predicts(gateway_stub):
    # x-request-start says it was sent 10 s ago: its 5 s TTFT target is lost before the gateway's handler ran.
    # Served while the gateway has no fresh prediction yet (fail open); refused at once after that.
    objectives = gateway_pb2.LatencyObjectives(ttft_ms=5000, tpot_ms=1000)
    for _ in range(200):
        sent_us = round((time.time() - 10.0) * 1e6)
        try:
            _generate(gateway_stub, objectives, (("x-request-start", f"t={sent_us}"),))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "before the gateway, past its TTFT target 5000 ms" in err.details()
            return
        time.sleep(0.1)
    pytest.fail("never refused: the gateway did not count the wait before it")


def test_a_served_stream_s_last_chunk_carries_the_ttft_the_gateway_predicted_at_admission(gateway_stub):
    # Once the gateway has polled a prediction: on the last chunk only, in microseconds, so a caller can set it
    # beside the TTFT it measured (bench_slo's per-stream predictor error).
    objectives = gateway_pb2.LatencyObjectives(ttft_ms=5000, tpot_ms=1000)
    for _ in range(200):
        chunks = _generate(gateway_stub, objectives)
        if chunks[-1].predicted_ttft_us > 0:
            assert chunks[-1].predicted_ttft_us < 5_000_000
            assert all(chunk.predicted_ttft_us == 0 for chunk in chunks[:-1])
            # Sent (as x-request-start says) 2 s before the gateway got it: counted from the send, as the caller
            # measures its TTFT, the prediction holds those 2 s.
            sent_us = round((time.time() - 2.0) * 1e6)
            late = _generate(gateway_stub, objectives, (("x-request-start", f"t={sent_us}"),))
            assert 2_000_000 <= late[-1].predicted_ttft_us < 5_000_000
            return
        time.sleep(0.1)
    pytest.fail("no chunk carried a predicted TTFT")
