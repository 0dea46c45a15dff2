"""The overload benchmark's load processes against a fake gateway: every planned request is sent,
from several processes, with its x-request-start, and its reply turned into a result."""

from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from bench.harness.load_plan import LoadPlan, RequestTemplate, Rpc, Send
from bench.harness.load_pool import LoadPool
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.integration

STAGES = [
    common_pb2.StageTiming(stage=common_pb2.STAGE_ADMISSION, duration_us=300, service="gateway"),
    common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=700, service="worker"),
    common_pb2.StageTiming(stage=common_pb2.STAGE_GATEWAY, duration_us=1500, service="gateway"),  # a total
]


class RecordingGateway(gateway_pb2_grpc.InferenceServicer):
    """Answers at once; `slow-key` callers wait past any short deadline. Records each x-request-start."""

    def __init__(self) -> None:
        self.request_starts_us: list[int] = []

    def _record(self, context) -> str:
        metadata = dict(context.invocation_metadata())
        self.request_starts_us.append(int(metadata["x-request-start"].removeprefix("t=")))
        return metadata["authorization"]

    def Classify(self, request, context):
        if self._record(context) == "Bearer slow-key":
            time.sleep(0.3)
        return gateway_pb2.ClassifyResponse(timings=common_pb2.Timings(stages=STAGES, total_us=1500))

    def Generate(self, request, context):
        self._record(context)
        for i in range(3):
            yield gateway_pb2.GenerateResponse(token_ids=[97], index=i)
        yield gateway_pb2.GenerateResponse(index=3, finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                           timings=common_pb2.Timings(stages=STAGES, total_us=1500))


@pytest.fixture(scope="module")
def fake_gateway():
    servicer = RecordingGateway()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    gateway_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


@pytest.fixture(scope="module")
def pool():
    with LoadPool(2) as load_pool:
        yield load_pool


def template(rpc: Rpc, api_key: str = "key", deadline_s: float = 2.0) -> RequestTemplate:
    body = (gateway_pb2.ClassifyRequest() if rpc is Rpc.CLASSIFY else gateway_pb2.GenerateRequest()).SerializeToString()
    return RequestTemplate(rpc, body, api_key, api_key, deadline_s)


def test_two_processes_send_every_request_on_schedule_with_its_request_start(fake_gateway, pool):
    servicer, address = fake_gateway
    servicer.request_starts_us.clear()
    sends = tuple(Send(0.005 * i, i % 2) for i in range(40))
    plan = LoadPlan((template(Rpc.CLASSIFY), template(Rpc.GENERATE)), sends, 0.2)
    began_unix_s = time.time()
    results = pool.replay(address, plan, num_procs=2)
    ended_unix_s = time.time()
    assert [r.scheduled_s for r in results] == [s.scheduled_s for s in sends]
    assert all(r.ok for r in results), {r.status for r in results}
    assert all(r.leaf_stage_us == 1000 for r in results)  # admission + compute, not the gateway total
    streams = results[1::2]
    assert all(r.num_tokens == 3 and 0 < r.ttft_s <= r.latency_s for r in streams)
    assert all(r.sent_s >= r.scheduled_s and r.done_s > r.sent_s for r in results)
    # Each header is the origin plus the request's scheduled offset: their spacing is the schedule's.
    starts_us = sorted(servicer.request_starts_us)
    assert len(starts_us) == 40
    assert [b - a for a, b in zip(starts_us, starts_us[1:], strict=False)] == pytest.approx([5000] * 39, abs=2)
    # Unix time of this replay, however slowly a loaded machine started it (was `< began + 5 s`).
    assert began_unix_s < starts_us[0] / 1e6 < ended_unix_s


def test_a_request_past_its_deadline_is_a_deadline_exceeded_result_with_the_servers_words(fake_gateway, pool):
    _, address = fake_gateway
    plan = LoadPlan((template(Rpc.CLASSIFY, "slow-key", deadline_s=0.05),), (Send(0.0, 0), Send(0.01, 0)), 0.02)
    results = pool.replay(address, plan, num_procs=1)
    assert [r.status for r in results] == ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED"]
    assert all(r.message and 0.04 < r.latency_s < 0.3 for r in results)
