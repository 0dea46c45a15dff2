"""What the HTTP tests of stored Responses and Conversations share: two tenants, a fake generator that
answers with the conversation it was given (so a test reads what a turn sent upstream), the real
OpenAI front over HttpServer on a free 127.0.0.1 port, and JSON calls to it."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.fronts.http_server import HttpServer
from services.gateway.fronts.openai_http import OpenAIFront
from services.gateway.fronts.openai_stored_http import StoredResponses
from services.gateway.fronts.response_store import ResponseStore
from services.gateway.quota.quotas import QuotaExceeded
from services.gateway.tenants.directory import TenantConfig, TenantDirectory, hash_api_key
from tests.unit.gateway.conftest import make_tenant
from tools.testbed.processes import free_port

ALPHA, BETA = "alpha-key", "beta-key"
TENANTS = TenantDirectory(TenantConfig((make_tenant("alpha", api_key_sha256=(hash_api_key(ALPHA),)),
                                         make_tenant("beta", api_key_sha256=(hash_api_key(BETA),))), "test"))
STORE_BYTES = 20_000


class EchoCore:
    """Answers every chat with the conversation it received, one `role:content` line per message, in two
    chunks (so a stream has deltas), after telling `on_admitted`; one containing REFUSE is refused as
    admission refuses (before `on_admitted`); a prompt containing FAIL fails after the first chunk (BUG: raises
    what no domain error is), one containing HOLD waits for `release` before its second. Counts the generations closed before their end."""

    def __init__(self) -> None:
        self.holding = asyncio.Event()  # set once a HOLD conversation waits
        self.release = asyncio.Event()
        self.num_abandoned = 0

    async def generate(self, request: gateway_pb2.GenerateRequest, caller, *, further_choice: bool = False,
                       on_admitted=None):
        TENANTS.authenticate(caller.authorization)
        text = "\n".join(f"{m.role}:{m.content}" for m in request.messages)
        if "REFUSE" in text:  # what admission refuses (a quota)
            raise QuotaExceeded("tenant 'alpha' is over its request rate quota", "requests_per_s", retry_after_s=2.0)
        if on_admitted is not None:
            on_admitted()
        yield gateway_pb2.GenerateResponse(text=text[:3])
        if "FAIL" in text:
            raise errors.Unavailable("the worker went away")
        if "BUG" in text:
            raise RuntimeError("a bug")
        try:
            if "HOLD" in text:
                self.holding.set()
                await self.release.wait()
        except asyncio.CancelledError:
            self.num_abandoned += 1
            raise
        usage = common_pb2.Usage(prompt_tokens=len(text), completion_tokens=len(text))
        yield gateway_pb2.GenerateResponse(text=text[3:], finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage)


async def list_models(authorization, timeout_s: float) -> gateway_pb2.ListModelsResponse:
    return gateway_pb2.ListModelsResponse()


async def serve(core: EchoCore, stored: StoredResponses | None):
    port = free_port()
    server = HttpServer(OpenAIFront(core, list_models, TENANTS.authenticate, stored=stored),
                        "127.0.0.1", port, None, max_body_bytes=1 << 20)
    await server.start()
    return server, f"http://127.0.0.1:{port}/v1"


async def call(method: str, url: str, body: dict | None = None, key: str | None = ALPHA) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session, session.request(method, url, json=body, headers=headers) as reply:
        return reply.status, await reply.json()


async def create(base: str, key: str = ALPHA, **body) -> dict:
    status, reply = await call("POST", base + "/responses", {"model": "m", **body}, key)
    assert status == 200, reply
    return reply


# The fixtures both HTTP test files use (imported there by name, which is how pytest finds them).
@pytest.fixture
def core() -> EchoCore:
    return EchoCore()


@pytest.fixture
async def base(core):
    """The front over a store small enough to fill (STORE_BYTES), tenants told apart by their keys."""
    store = ResponseStore(STORE_BYTES, ttl_s=3600)
    server, url = await serve(core, StoredResponses(store, lambda a: TENANTS.authenticate(a).tenant_id))
    yield url
    await server.close()


@pytest.fixture
async def stateless_base(core):
    """The front of a gateway that stores nothing."""
    server, url = await serve(core, None)
    yield url
    await server.close()
