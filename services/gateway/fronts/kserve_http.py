"""KServe v2 REST (`/v2/...`) on the gateway's HTTP port, next to the OpenAI API.

Thin: read the caller from the headers (the same ones as the OpenAI front: `Authorization:
Bearer <key>`, x-infermesh-timeout-ms, x-infermesh-priority, traceparent), run kserve_core,
write JSON, map domain errors to KServe's `{"error": "<message>"}` with the same HTTP codes as
the OpenAI front (400, 401, 403, 404, 429 with Retry-After, 503, 504).

    GET  /v2                                        server metadata
    GET  /v2/health/live | /v2/health/ready         200, or 503 when not ready
    GET  /v2/models/{name}[/versions/{v}]           model metadata
    GET  /v2/models/{name}[/versions/{v}]/ready     200, or 503 when no worker serves it
    GET  /v2/models/{name}[/versions/{v}]/config    Triton's model configuration
    GET  /v2/models[/{name}[/versions/{v}]]/stats   Triton's statistics
    POST /v2/repository/index                       every model version and its state
    POST /v2/models/{name}[/versions/{v}]/infer     classifier, tensor or embedding inference (JSON or binary tensors)
    POST /v2/models/{name}[/versions/{v}]/generate  generator, one answer (Triton's generate extension)
    POST /v2/models/{name}[/versions/{v}]/generate_stream   the same as server-sent events
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from aiohttp import web

from inference import grpc_predict_v2_pb2 as kserve
from services.common import errors
from services.gateway.fronts import json_body, kserve_http_codec
from services.gateway.fronts.caller import http_authorization, http_caller
from services.gateway.fronts.http_refusals import refusal_middleware
from services.gateway.fronts.http_status import http_refusal
from services.gateway.fronts.server_timing import TIMINGS_HEADER, header_value
from services.gateway.kserve.core import EXTENSIONS, SERVER_NAME, SERVER_VERSION, KServeCore

PREFIX = "/v2"
_MODEL = "/v2/models/{name}"
_VERSION = "/v2/models/{name}/versions/{version}"


def error_response(err: errors.InfermeshError) -> web.Response:
    refusal = http_refusal(err)
    return web.json_response({"error": err.message}, status=refusal.status, headers=refusal.headers())


class KServeHttp:
    def __init__(self, core: KServeCore, ready: Callable[[], bool]) -> None:
        self._core = core
        self._ready = ready

    def routes(self) -> list[web.RouteDef]:
        routes = [
            web.get(PREFIX, self.server_metadata),
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.ready),
            web.get("/v2/models/stats", self.statistics),
            web.post("/v2/repository/index", self.index),
        ]
        for base in (_MODEL, _VERSION):
            routes += [
                web.get(base, self.metadata),
                web.get(base + "/ready", self.model_ready),
                web.get(base + "/config", self.config),
                web.get(base + "/stats", self.statistics),
                web.post(base + "/infer", self.infer),
                web.post(base + "/generate", self.generate),
                web.post(base + "/generate_stream", self.generate_stream),
            ]
        return routes

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self._ready()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def metadata(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        answer = await self._core.model_metadata(name, version, http_authorization(request))
        return web.json_response(kserve_http_codec.plain(answer))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        ready = await self._core.model_ready(name, version, http_authorization(request))
        return web.json_response({"name": name, "ready": ready}, status=200 if ready else 503)

    async def config(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        answer = await self._core.model_config(name, version, http_authorization(request))
        return web.json_response(kserve_http_codec.plain(answer.config))

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        answer = self._core.model_statistics(name, version, http_authorization(request))
        return web.json_response({"model_stats": [kserve_http_codec.plain(s) for s in answer.model_stats]})

    async def index(self, request: web.Request) -> web.Response:
        body = await _body(request)
        try:
            document = json_body.loads(body) if body.strip() else {}
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        if not isinstance(document, dict) or not isinstance(document.get("ready", False), bool):
            raise errors.InvalidArgument("the body must be an object whose 'ready' is true or false")
        answer = self._core.repository_index(document.get("ready", False), http_authorization(request))
        return web.json_response([kserve_http_codec.plain(m) for m in answer.models])

    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model_of(request)
        try:
            caller = http_caller(request)
            inference = kserve_http_codec.parse_infer(await _body(request),
                                                      request.headers.get(kserve_http_codec.HEADER_LENGTH),
                                                      name, version)
        except errors.InfermeshError as err:
            self._core.authenticate(http_authorization(request))  # an unknown caller learns nothing about bodies
            raise err from None
        answer, timings = await self._core.infer_timed(inference.request, caller)
        body, header_length = kserve_http_codec.infer_response(answer, inference)
        headers = {TIMINGS_HEADER: header_value(timings)}  # and Server-Timing (http_server)
        if header_length is None:
            return web.Response(body=body, content_type="application/json", headers=headers)
        headers[kserve_http_codec.HEADER_LENGTH] = str(header_length)
        return web.Response(body=body, content_type="application/octet-stream", headers=headers)


    async def generate(self, request: web.Request) -> web.Response:
        async with aclosing(await self._generation(request)) as responses:
            documents = [kserve_http_codec.generate_document(r) async for r in responses]
        return web.json_response(kserve_http_codec.joined_documents(documents))

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events, one per stream response; an error after the first is a last
        `data: {"error": ...}` event (before it, the status and body of any refusal)."""
        async with aclosing(await self._generation(request)) as responses:
            first = await anext(responses)  # admission and the first token, before any byte is sent
            stream = web.StreamResponse(headers=_SSE_HEADERS)
            await stream.prepare(request)
            await stream.write(_event(kserve_http_codec.generate_document(first)))
            try:
                async for response in responses:
                    await stream.write(_event(kserve_http_codec.generate_document(response)))
            except errors.InfermeshError as err:
                await stream.write(_event({"error": err.message}))
            await stream.write_eof()
            return stream

    async def _generation(self, request: web.Request) -> AsyncGenerator[kserve.ModelInferResponse, None]:
        name, version = _model_of(request)
        try:
            caller = http_caller(request)
            infer_request = kserve_http_codec.parse_generate(await _body(request), name, version)
        except errors.InfermeshError as err:
            self._core.authenticate(http_authorization(request))  # an unknown caller learns nothing about bodies
            raise err from None
        return self._core.stream(infer_request, caller)


_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _event(document: dict) -> bytes:
    return b"data: " + json.dumps(document, separators=(",", ":")).encode() + b"\n\n"


def _model_of(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("name", ""), request.match_info.get("version", "")


async def _body(request: web.Request) -> bytes:
    try:
        return await json_body.body(request)
    except ValueError as exc:  # its Content-Encoding
        raise errors.InvalidArgument(str(exc)) from None


def _plain_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


# Every /v2 refusal as KServe's `{"error": "..."}`.
kserve_errors = refusal_middleware(error_response, _plain_error)
