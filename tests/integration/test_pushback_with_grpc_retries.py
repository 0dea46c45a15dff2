"""A stock gRPC client with a retry policy retries our "go elsewhere now" refusals.

grpcio's own retries (a retryPolicy in the channel's service config) honour the
`grpc-retry-pushback-ms` trailer, but a pushback of "0" makes the call wait for its
deadline instead of retrying (grpcio 1.85). The mesh answers "retry at once" (a draining
scheduler, passed on by the gateway when it has nowhere left to send a call) with 1 ms.
An overload refusal (RESOURCE_EXHAUSTED with its retry hint) is retried after the hint, not
the policy's backoff, by a client that lists the code (docs/operations.md, "Overload refusals").
"""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import errors
from services.common.status import abort

pytestmark = pytest.mark.integration


def _retry_policy(*codes: str) -> str:
    return json.dumps({"methodConfig": [{
        "name": [{"service": "grpc.health.v1.Health"}],
        "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.01s", "maxBackoff": "0.05s",
                        "backoffMultiplier": 2, "retryableStatusCodes": list(codes)},
    }]})


class _RefusesOnce(health_pb2_grpc.HealthServicer):
    def __init__(self, refusal: errors.InfermeshError) -> None:
        self.refusal = refusal
        self.call_times: list[float] = []

    async def Check(self, request, context):
        self.call_times.append(time.monotonic())
        if len(self.call_times) == 1:
            await abort(context, self.refusal)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _call_through_retries(refusal: errors.InfermeshError, policy: str) -> tuple[int, list[float]]:
    servicer = _RefusesOnce(refusal)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        options = [("grpc.service_config", policy), ("grpc.enable_retries", 1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status, servicer.call_times
    finally:
        await server.stop(0)


def test_a_retry_at_once_hint_is_retried_by_grpc_own_retry_policy():
    refusal = errors.Unavailable("draining: call another scheduler", retry_after_s=0.0)
    status, call_times = asyncio.run(_call_through_retries(refusal, _retry_policy("UNAVAILABLE")))
    assert (status, len(call_times)) == (health_pb2.HealthCheckResponse.SERVING, 2)


def test_an_overload_refusal_is_retried_after_its_hint_not_the_policy_backoff():
    refusal = errors.ResourceExhausted("overloaded: the adaptive limit", retry_after_s=0.3)
    status, call_times = asyncio.run(_call_through_retries(refusal, _retry_policy("UNAVAILABLE", "RESOURCE_EXHAUSTED")))
    assert (status, len(call_times)) == (health_pb2.HealthCheckResponse.SERVING, 2)
    assert call_times[1] - call_times[0] >= 0.25  # the policy's own backoff is at most 0.05 s
