"""KServe v2 / Triton at the edge, whatever the transport: the gRPC servicer and the /v2 REST front run this.

Model-scoped calls authenticate like the infermesh API (`Bearer <key>`; development mode admits
all) and see only the models their tenant may use. A front hands in KServe messages and what its
transport said about the caller (generate_core.Caller) and gets KServe messages or a domain
error (services/common/errors.py), which it maps to its own status codes.

Inference runs the same admission (auth, deadline, shedding, quota, the model's adaptive limit)
and the same retrying dispatcher as infermesh.v1 Classify / Generate. A classifier request of
N images is one admitted request whose N images go upstream at once, so the scheduler's
dynamic batcher can put them in one batch; N may not exceed the batch size the scheduler runs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.log_context import bind
from services.gateway.admission.admission import Admission, RequestScope
from services.gateway.calls.generate_core import Caller, GenerateCore, parse_priority
from services.gateway.kserve import codec as kserve_codec
from services.gateway.kserve import embed as kserve_embed
from services.gateway.kserve import models as kserve_models
from services.gateway.kserve import stream as kserve_stream
from services.gateway.kserve import tensor_codec
from services.gateway.kserve.stats import ModelStatistics
from services.gateway.routing.catalog import ModelCatalog
from services.gateway.telemetry.tracing import span
from services.gateway.tenants.credentials import Authorization

# The catalog is refreshed on a miss at most this often, so unknown-model floods stay cheap.
_MIN_REFRESH_INTERVAL_S = 0.25

Classify = Callable[[RequestScope, gateway_pb2.ClassifyRequest], Awaitable[gateway_pb2.ClassifyResponse]]

# What ServerMetadata answers on both KServe fronts (gRPC and REST).
SERVER_NAME = "infermesh"
SERVER_VERSION = "0.1.0"
# Triton's protocol extensions the gateway implements.
EXTENSIONS = ["classification", "model_configuration", "statistics", "model_repository"]


class KServeCore:
    def __init__(self, *, admission: Admission, catalog: ModelCatalog, refresh_catalog: Callable[[], Awaitable[None]],
                 classify: Classify, generate: GenerateCore, statistics: ModelStatistics | None = None,
                 clock=time.monotonic) -> None:
        self._admission = admission
        self._catalog = catalog
        self._refresh_catalog = refresh_catalog
        self._classify = classify
        self._generate = generate
        self.statistics = statistics or ModelStatistics()
        self._clock = clock
        self._refreshed_s = float("-inf")
        self._refreshing: asyncio.Task[None] | None = None

    # -- model-scoped reads ------------------------------------------------------------

    async def model_ready(self, name: str, version: str, authorization: Authorization) -> bool:
        self.authorize(authorization, name)
        try:
            info = await self.model(name, version)
        except (errors.NotFound, errors.InvalidArgument):
            return False
        return info.ready

    async def model_metadata(self, name: str, version: str,
                             authorization: Authorization) -> kserve.ModelMetadataResponse:
        self.authorize(authorization, name)
        info = await self.model(name, version)
        versions = [version] if version else [i.model.version for i in self._catalog.versions(name)]
        return kserve_models.model_metadata(info, versions)

    async def model_config(self, name: str, version: str, authorization: Authorization) -> kserve.ModelConfigResponse:
        self.authorize(authorization, name)
        return kserve.ModelConfigResponse(config=kserve_models.model_config(await self.model(name, version)))

    def model_statistics(self, name: str, version: str, authorization: Authorization) -> kserve.ModelStatisticsResponse:
        tenant = self._admission.parts.tenants.authenticate(authorization)
        if name:
            self._admission.parts.tenants.check_model_allowed(tenant, name)
        elif version:
            raise errors.InvalidArgument("a version needs a model name")
        snapshot = [s for s in self.statistics.snapshot(name, version) if tenant.may_use(s.name)]
        if name and not snapshot and not self._catalog.knows(name):
            raise errors.NotFound(f"model {name!r} is not served here")
        return kserve_models.statistics_response(snapshot)

    def repository_index(self, ready_only: bool, authorization: Authorization) -> kserve.RepositoryIndexResponse:
        tenant = self._admission.parts.tenants.authenticate(authorization)
        models = [info for info in self._catalog.all_models() if tenant.may_use(info.model.name)]
        return kserve_models.repository_index(models, ready_only)

    def authenticate(self, authorization: Authorization) -> None:
        self._admission.parts.tenants.authenticate(authorization)

    def authorize(self, authorization: Authorization, model_name: str) -> None:
        tenants = self._admission.parts.tenants
        tenants.check_model_allowed(tenants.authenticate(authorization), model_name)

    async def model(self, name: str, version: str) -> gateway_pb2.ModelInfo:
        """The attached model `name` (at `version`, or the one routed to), or the status why not."""
        if not name:
            raise errors.InvalidArgument("model name is required")
        route = self._admission.parts.routing.model(name)  # NotFound when a routing table does not list it
        version = version or route.default_version
        info = self._find(name, version)
        if info is None:
            await self._refreshed()
            info = self._find(name, version)
        if info is None:
            shown = f"{name}:{version}" if version else name
            raise errors.NotFound(f"model {shown!r} is not served here")
        return info

    async def _refreshed(self) -> None:
        """Wait for a catalog refresh: the one in flight if any (callers that miss together must
        not fail while another's refresh is still under way), else a new one, at most every
        _MIN_REFRESH_INTERVAL_S."""
        if self._refreshing is None or self._refreshing.done():
            if self._clock() - self._refreshed_s < _MIN_REFRESH_INTERVAL_S:
                return
            self._refreshed_s = self._clock()
            self._refreshing = asyncio.ensure_future(self._refresh_catalog())
        await asyncio.shield(self._refreshing)

    def _find(self, name: str, version: str) -> gateway_pb2.ModelInfo | None:
        versions = self._catalog.versions(name)
        if version:
            return next((i for i in versions if i.model.version == version), None)
        if len(versions) > 1:
            shown = ", ".join(i.model.version for i in versions)
            raise errors.InvalidArgument(f"model {name!r} has versions {shown}; name one in model_version")
        return versions[0] if versions else None

    # -- inference -----------------------------------------------------------------------

    async def infer(self, request: kserve.ModelInferRequest, caller: Caller) -> kserve.ModelInferResponse:
        """A classifier request of one or N images, a tensor model's request of N rows (each row one
        upstream Classify, so rows batch across callers), or an embedding model's text (one Generate with
        `embed`, kserve/embed.py); generators answer through `stream`."""
        response, _ = await self.infer_timed(request, caller)
        return response

    async def infer_timed(self, request: kserve.ModelInferRequest,
                          caller: Caller) -> tuple[kserve.ModelInferResponse, common_pb2.Timings]:
        """`infer`, and the stage timings of its slowest upstream call (the REST front's Server-Timing)."""
        request_id = request.id or uuid.uuid4().hex
        bind(request_id=request_id)
        embedding = await self._embedding_model(request)
        if embedding is not None:
            return await self._embed(request, caller, embedding, request_id)
        with self._admission.scope("ModelInfer", request.model_name, request.model_version,
                                   caller.metadata, caller.authorization) as scope:
            with span("admission"):
                self._admission.admit(scope, caller.authorization, caller.timeout_s,
                                      priority=parse_priority(caller.priority),
                                      check_request=lambda: _require_model_name(request.model_name))
                info = await self.model(request.model_name, request.model_version)
                _require_classifier(info)
                if tensor_codec.is_tensor(info):
                    rows = tensor_codec.decode_rows(request, info, kserve_models.max_batch_size(info))
                    outputs = tensor_codec.requested_outputs(request, info)
                    payloads = [{"inputs": row} for row in rows.rows]
                else:
                    decoded = kserve_codec.decode_images(request)
                    outputs = kserve_codec.requested_outputs(request)
                    _check_batch_size(info, len(decoded.images))
                    payloads = [{"image": image} for image in decoded.images]
            with self._counted(info, len(payloads)) as served:
                answers = await self._classify_all(scope, request, info, payloads, request_id)
                served.timings = timings = max((a.timings for a in answers), key=lambda t: t.total_us)
                response = kserve.ModelInferResponse(model_name=request.model_name,
                                                     model_version=answers[0].model.version, id=request.id)
                if tensor_codec.is_tensor(info):
                    tensor_codec.encode_outputs(response, outputs, answers, info)
                else:
                    batch = [kserve_codec.scores_from_labels(info.labels, a.labels) for a in answers]
                    kserve_codec.encode_outputs(response, outputs, batch, decoded.batched)
                return response, timings

    async def _embedding_model(self, request: kserve.ModelInferRequest) -> gateway_pb2.ModelInfo | None:
        """The embedding model the request names, if it names one; None for anything else, which the
        classifier path admits and refuses in its own order (an unknown model, a missing name included)."""
        if not request.model_name:
            return None
        try:
            info = await self.model(request.model_name, request.model_version)
        except (errors.NotFound, errors.InvalidArgument):
            return None
        return info if kserve_models.is_embedding(info) else None

    async def _embed(self, request: kserve.ModelInferRequest, caller: Caller, info: gateway_pb2.ModelInfo,
                     request_id: str) -> tuple[kserve.ModelInferResponse, common_pb2.Timings]:
        """An embedding model's request: one Generate with `embed`, admitted by GenerateCore like any."""
        self.authorize(caller.authorization, request.model_name)  # before its body is judged
        parsed = kserve_embed.parse_embed_request(request, info, request_id)
        with self._counted(info, 1) as served:
            last = None
            async with aclosing(self._generate.generate(parsed.generate, caller)) as chunks:
                try:
                    async for chunk in chunks:
                        last = chunk
                except errors.InvalidArgument as err:
                    raise kserve_embed.named_refusal(parsed, err) from None
            if last is None or not last.embedding:
                raise errors.Internal("the scheduler's answer carried no embedding")
            served.timings = last.timings
            return kserve_embed.embed_response(parsed, last), last.timings

    async def _classify_all(self, scope: RequestScope, request: kserve.ModelInferRequest, info: gateway_pb2.ModelInfo,
                            payloads: Sequence[dict[str, Any]], request_id: str) -> list[gateway_pb2.ClassifyResponse]:
        """`payloads`: each upstream call's `image` or `inputs` (a tensor model's row)."""
        def upstream(index: int, payload: dict[str, Any]) -> gateway_pb2.ClassifyRequest:
            return gateway_pb2.ClassifyRequest(
                model=common_pb2.ModelRef(name=request.model_name, version=request.model_version),
                top_k=max(1, len(info.labels)),  # every class, so PROBABILITIES is complete
                request_id=request_id if len(payloads) == 1 else f"{request_id}/{index}",
                **payload,
            )

        tasks = [asyncio.ensure_future(self._classify(scope, upstream(i, p))) for i, p in enumerate(payloads)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one image failed: the request has failed, its others need not run
                task.cancel()
            raise

    async def stream(self, request: kserve.ModelInferRequest,
                     caller: Caller) -> AsyncGenerator[kserve.ModelInferResponse, None]:
        """One generator request of a ModelStreamInfer stream: its responses, the last flagged final.

        Admission runs on the first iteration, so a refusal is raised before any response."""
        if not request.model_name:
            raise errors.InvalidArgument("model_name is required")
        self.authorize(caller.authorization, request.model_name)
        info = await self.model(request.model_name, request.model_version)
        if kserve_models.is_embedding(info):
            raise errors.InvalidArgument(
                f"model {info.model.name}:{info.model.version} is an embedding model: send its requests with "
                f"ModelInfer (REST: /infer), which answers its '{kserve_models.EMBEDDING_OUTPUT}'")
        if not kserve_models.is_generator(info):
            raise errors.InvalidArgument(
                f"model {info.model.name}:{info.model.version} is a classifier; ModelStreamInfer serves "
                f"generator models (send classifier requests with ModelInfer)")
        parsed = kserve_stream.parse_stream_request(request)
        with self._counted(info, 1) as served:
            async with aclosing(self._generate.generate(parsed.generate, caller)) as chunks:
                try:
                    async for chunk in chunks:
                        if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            served.timings = chunk.timings
                        for response in kserve_stream.chunk_responses(parsed, chunk):
                            yield response
                except errors.InvalidArgument as err:
                    raise kserve_stream.named_refusal(parsed, err) from None

    def _counted(self, info: gateway_pb2.ModelInfo, num_inferences: int) -> _Served:
        return _Served(self.statistics, info.model.name, info.model.version, num_inferences, self._clock)


class _Served:
    """Counts one request in the model's statistics: a success with its timings, or a failure."""

    def __init__(self, statistics: ModelStatistics, name: str, version: str, num_inferences: int, clock) -> None:
        self._statistics = statistics
        self._key = (name, version)
        self._num_inferences = num_inferences
        self._clock = clock
        self.timings: common_pb2.Timings | None = None

    def __enter__(self) -> _Served:
        self._began_s = self._clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        duration_s = self._clock() - self._began_s
        if exc_type is None and self.timings is not None:
            self._statistics.succeeded(*self._key, duration_s, kserve_models.stage_durations(self.timings),
                                       self._num_inferences)
        elif exc_type not in (GeneratorExit, asyncio.CancelledError):  # the client went away: not the model failing
            self._statistics.failed(*self._key, duration_s)


def _require_model_name(name: str) -> None:
    if not name:
        raise errors.InvalidArgument("model_name is required")


def _require_classifier(info: gateway_pb2.ModelInfo) -> None:
    if kserve_models.is_generator(info):
        raise errors.InvalidArgument(
            f"model {info.model.name}:{info.model.version} is a generator (decoupled): "
            f"use ModelStreamInfer for it; ModelInfer serves classifier models")


def _check_batch_size(info: gateway_pb2.ModelInfo, num_images: int) -> None:
    limit = kserve_models.max_batch_size(info)
    if num_images > limit:
        raise errors.InvalidArgument(
            f"input 'IMAGE' holds {num_images} images; model {info.model.name}:{info.model.version} "
            f"takes at most {limit} per request (its max_batch_size)")
