"""The health service answers List (found by the reflection-driven fuzz, tests/fuzz: reflection lists
grpc.health.v1.Health/List, and the stock aio servicer answered it UNKNOWN "Method not implemented")."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from services.common.server import Health

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _listed(health: Health) -> dict[str, int]:
    reply = await health.servicer.List(health_pb2.HealthListRequest(), None)
    return {name: response.status for name, response in reply.statuses.items()}


async def test_list_names_the_server_and_every_service_with_their_status():
    health = Health(("infermesh.v1.Scheduler",))
    assert await _listed(health) == {"": NOT_SERVING, "infermesh.v1.Scheduler": NOT_SERVING}
    await health.set_serving(True)
    assert await _listed(health) == {"": SERVING, "infermesh.v1.Scheduler": SERVING}


async def test_list_stays_not_serving_once_draining():
    health = Health(("infermesh.v1.Scheduler",))
    await health.set_serving(True)
    await health.enter_drain()
    await health.set_serving(True)
    assert await _listed(health) == {"": NOT_SERVING, "infermesh.v1.Scheduler": NOT_SERVING}
    check = await health.servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
    assert check.status == NOT_SERVING
