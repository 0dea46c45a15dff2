"""KServe v2 / Triton `inference.GRPCInferenceService` on the gateway port, for classifier models.

ModelInfer goes through the same admission path (auth, deadline, shedding,
quota) and the same retrying dispatcher as infermesh.v1 Classify; the tensor
contract is in `kserve_codec`. Model-scoped calls authenticate like the
infermesh API (`authorization: Bearer <key>`; development mode admits all);
ServerLive / ServerReady / ServerMetadata answer anyone, as probes do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.log_context import bind
from services.common.status import maps_domain_errors
from services.gateway import kserve_codec
from services.gateway.admission import Admission, RequestScope, span
from services.gateway.pressure_poller import ModelCatalog
from services.gateway.servicer import authorization_of, client_timeout_s

SERVER_NAME = "infermesh"
SERVER_VERSION = "0.1.0"
# The catalog is refreshed on a miss at most this often, so unknown-model floods stay cheap.
_MIN_REFRESH_INTERVAL_S = 0.25

Classify = Callable[[RequestScope, gateway_pb2.ClassifyRequest], Awaitable[gateway_pb2.ClassifyResponse]]


class KServeServicer(kserve_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self,
        *,
        admission: Admission,
        catalog: ModelCatalog,
        refresh_catalog: Callable[[], Awaitable[None]],
        classify: Classify,
        ready: Callable[[], bool],
        clock=time.monotonic,
    ) -> None:
        self._admission = admission
        self._catalog = catalog
        self._refresh_catalog = refresh_catalog
        self._classify = classify
        self._ready = ready
        self._clock = clock
        self._refreshed_s = float("-inf")

    async def ServerLive(self, request, context) -> kserve.ServerLiveResponse:
        return kserve.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context) -> kserve.ServerReadyResponse:
        return kserve.ServerReadyResponse(ready=self._ready())

    async def ServerMetadata(self, request, context) -> kserve.ServerMetadataResponse:
        return kserve.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=["classification"])

    @maps_domain_errors
    async def ModelReady(self, request: kserve.ModelReadyRequest, context) -> kserve.ModelReadyResponse:
        self._authorize(context, request.name)
        try:
            info = await self._classifier(request.name, request.version)
        except (errors.NotFound, errors.InvalidArgument):
            return kserve.ModelReadyResponse(ready=False)
        return kserve.ModelReadyResponse(ready=info.ready)

    @maps_domain_errors
    async def ModelMetadata(self, request: kserve.ModelMetadataRequest, context) -> kserve.ModelMetadataResponse:
        self._authorize(context, request.name)
        info = await self._classifier(request.name, request.version)
        versions = [request.version] if request.version else [i.model.version for i in self._catalog.versions(request.name)]
        return kserve_codec.model_metadata(request.name, versions, len(info.labels))

    @maps_domain_errors
    async def ModelInfer(self, request: kserve.ModelInferRequest, context) -> kserve.ModelInferResponse:
        metadata = context.invocation_metadata()
        authorization = authorization_of(metadata)
        request_id = request.id or uuid.uuid4().hex
        bind(request_id=request_id)
        with self._admission.scope("ModelInfer", request.model_name, request.model_version,
                                   metadata, authorization) as scope:
            with span("admission"):
                if not request.model_name:
                    raise errors.InvalidArgument("model_name is required")
                self._admission.admit(scope, authorization, client_timeout_s(context))
                info = await self._classifier(request.model_name, request.model_version)
                image = kserve_codec.decode_image(request)
                outputs = kserve_codec.requested_outputs(request)
            classify = gateway_pb2.ClassifyRequest(
                model=common_pb2.ModelRef(name=request.model_name, version=request.model_version),
                image=image,
                top_k=max(1, len(info.labels)),  # every class, so PROBABILITIES is complete
                request_id=request_id,
            )
            answer = await self._classify(scope, classify)
            response = kserve.ModelInferResponse(
                model_name=request.model_name, model_version=answer.model.version, id=request.id
            )
            scores = kserve_codec.scores_from_labels(info.labels, answer.labels)
            kserve_codec.encode_outputs(response, outputs, scores)
            return response

    # -- helpers ---------------------------------------------------------------------

    def _authorize(self, context, model_name: str) -> None:
        tenants = self._admission.parts.tenants
        tenant = tenants.authenticate(authorization_of(context.invocation_metadata()))
        tenants.check_model_allowed(tenant, model_name)

    async def _classifier(self, name: str, version: str) -> gateway_pb2.ModelInfo:
        """The attached classifier `name` (at `version`, or the one routed to), or the status why not."""
        if not name:
            raise errors.InvalidArgument("model name is required")
        route = self._admission.parts.routing.model(name)  # NotFound when a routing table does not list it
        version = version or route.default_version
        info = self._find(name, version)
        if info is None and self._clock() - self._refreshed_s >= _MIN_REFRESH_INTERVAL_S:
            self._refreshed_s = self._clock()
            await self._refresh_catalog()
            info = self._find(name, version)
        if info is None:
            shown = f"{name}:{version}" if version else name
            raise errors.NotFound(f"model {shown!r} is not served here")
        if info.kind != common_pb2.MODEL_KIND_CLASSIFIER:
            raise errors.InvalidArgument(
                f"model {info.model.name}:{info.model.version} is a {common_pb2.ModelKind.Name(info.kind)}; "
                f"the KServe v2 endpoint serves classifier models only"
            )
        return info

    def _find(self, name: str, version: str) -> gateway_pb2.ModelInfo | None:
        versions = self._catalog.versions(name)
        if version:
            return next((i for i in versions if i.model.version == version), None)
        if len(versions) > 1:
            shown = ", ".join(i.model.version for i in versions)
            raise errors.InvalidArgument(f"model {name!r} has versions {shown}; name one in model_version")
        return versions[0] if versions else None
