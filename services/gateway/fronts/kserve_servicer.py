"""KServe v2 / Triton `inference.GRPCInferenceService` on the gateway port.

Thin: read the caller from the metadata, run kserve_core, map domain errors to gRPC statuses.
ServerLive / ServerReady / ServerMetadata answer anyone, as probes do; model-scoped calls
authenticate like the infermesh API (`authorization: Bearer <key>`).

ModelStreamInfer (Triton's decoupled streaming, generator models): the requests of one stream
run concurrently, their responses interleave, each carrying its request's id. A request that
fails gets a stream response with `error_message` and the stream stays open for the others:
that is what Triton does and what tritonclient expects (its stream callback gets an
InferenceServerException for that request, and the stream keeps working); a gRPC status would
end every request on the stream. The response's `infer_response` carries the request's id and
the parameter `status` (the gRPC code name, e.g. RESOURCE_EXHAUSTED) so a client can act on it.
Only a bad API key, which no request on the stream could get past, ends the stream with
UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from services.common import errors
from services.common.status import abort, maps_domain_errors, status_code_of
from services.gateway.calls.generate_core import Caller
from services.gateway.fronts.caller import grpc_caller, grpc_credentials
from services.gateway.kserve.core import EXTENSIONS, SERVER_NAME, SERVER_VERSION, KServeCore
from services.gateway.tenants.credentials import Authorization

log = logging.getLogger(__name__)

# Stream responses waiting for a slow reader before the generations producing them wait too.
_MAX_QUEUED_RESPONSES = 64


class KServeServicer(kserve_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: KServeCore, ready: Callable[[], bool]) -> None:
        self._core = core
        self._ready = ready

    async def ServerLive(self, request, context) -> kserve.ServerLiveResponse:
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> kserve.ServerReadyResponse:
        return kserve.ServerReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request, context) -> kserve.ServerMetadataResponse:
        return kserve.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    @maps_domain_errors
    async def ModelReady(self, request: kserve.ModelReadyRequest, context) -> kserve.ModelReadyResponse:
        ready = await self._core.model_ready(request.name, request.version, _authorization(context))
        return kserve.ModelReadyResponse(ready=ready)

    @maps_domain_errors
    async def ModelMetadata(self, request: kserve.ModelMetadataRequest, context) -> kserve.ModelMetadataResponse:
        return await self._core.model_metadata(request.name, request.version, _authorization(context))

    @maps_domain_errors
    async def ModelConfig(self, request: kserve.ModelConfigRequest, context) -> kserve.ModelConfigResponse:
        return await self._core.model_config(request.name, request.version, _authorization(context))

    @maps_domain_errors
    async def ModelStatistics(self, request: kserve.ModelStatisticsRequest,
                              context) -> kserve.ModelStatisticsResponse:
        return self._core.model_statistics(request.name, request.version, _authorization(context))

    @maps_domain_errors
    async def RepositoryIndex(self, request: kserve.RepositoryIndexRequest,
                              context) -> kserve.RepositoryIndexResponse:
        return self._core.repository_index(request.ready, _authorization(context))

    @maps_domain_errors
    async def ModelInfer(self, request: kserve.ModelInferRequest, context) -> kserve.ModelInferResponse:
        return await self._core.infer(request, grpc_caller(context))

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[kserve.ModelStreamInferResponse]:
        try:
            self._core.authenticate(_authorization(context))
        except errors.InfermeshError as err:
            await abort(context, err)
        queue: asyncio.Queue[kserve.ModelStreamInferResponse | None] = asyncio.Queue(_MAX_QUEUED_RESPONSES)
        reader = asyncio.create_task(self._serve_requests(request_iterator, context, queue), name="stream-infer")
        try:
            while (response := await queue.get()) is not None:
                yield response
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _serve_requests(self, request_iterator, context, queue: asyncio.Queue) -> None:
        """Starts each request as it arrives; puts None once the client is done and every request is."""
        running: set[asyncio.Task] = set()
        try:
            async for request in request_iterator:
                task = asyncio.create_task(self._serve_one(request, grpc_caller(context), queue))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        except asyncio.CancelledError:  # the reply stream is gone: nobody reads the queue any more
            await _cancel(running)
            raise
        except Exception as exc:  # the request stream broke: what is running cannot be answered
            log.info("ModelStreamInfer request stream ended: %s", exc)
            await _cancel(running)
        await queue.put(None)

    async def _serve_one(self, request: kserve.ModelInferRequest, caller: Caller, queue: asyncio.Queue) -> None:
        try:
            async with aclosing(self._core.stream(request, caller)) as responses:
                async for response in responses:
                    await queue.put(kserve.ModelStreamInferResponse(infer_response=response))
        except errors.InfermeshError as err:
            await queue.put(_stream_error(request, err))
        except Exception:
            log.exception("ModelStreamInfer request %r failed", request.id)
            await queue.put(_stream_error(request, errors.Internal("internal error")))


async def _cancel(tasks: set[asyncio.Task]) -> None:
    """Cancels the generations still running (each closes its upstream stream, freeing its blocks)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _authorization(context) -> Authorization:
    return grpc_credentials(context)


def _stream_error(request: kserve.ModelInferRequest, err: errors.InfermeshError) -> kserve.ModelStreamInferResponse:
    response = kserve.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                         id=request.id)
    response.parameters["status"].string_param = status_code_of(err).name
    retry_after_s = getattr(err, "retry_after_s", None)
    if retry_after_s is not None:
        response.parameters["retry_after_ms"].int64_param = int(retry_after_s * 1000)
    return kserve.ModelStreamInferResponse(error_message=err.message, infer_response=response)
