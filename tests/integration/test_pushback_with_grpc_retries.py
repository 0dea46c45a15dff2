"""A stock gRPC client with a retry policy retries our "go elsewhere now" refusals.

grpcio's own retries (a retryPolicy in the channel's service config) honour the
`grpc-retry-pushback-ms` trailer, but a pushback of "0" makes the call wait for its
deadline instead of retrying (grpcio 1.85). The mesh answers "retry at once" (a draining
scheduler, passed on by the gateway when it has nowhere left to send a call) with 1 ms.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import errors
from services.common.status import abort

pytestmark = pytest.mark.integration

_RETRY_ON_UNAVAILABLE = json.dumps({"methodConfig": [{
    "name": [{"service": "grpc.health.v1.Health"}],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
}]})


class _RefusesOnceAtOnce(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.num_calls = 0

    async def Check(self, request, context):
        self.num_calls += 1
        if self.num_calls == 1:
            await abort(context, errors.Unavailable("draining: call another scheduler", retry_after_s=0.0))
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


async def _call_through_retries() -> tuple[int, int]:
    servicer = _RefusesOnceAtOnce()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        options = [("grpc.service_config", _RETRY_ON_UNAVAILABLE), ("grpc.enable_retries", 1)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        return reply.status, servicer.num_calls
    finally:
        await server.stop(0)


def test_a_retry_at_once_hint_is_retried_by_grpc_own_retry_policy():
    status, num_calls = asyncio.run(_call_through_retries())
    assert (status, num_calls) == (health_pb2.HealthCheckResponse.SERVING, 2)
