"""The Target over infermesh's own gateway API (infermesh.v1.Inference), on grpc.aio (`grpc://`).

It turns
a PlannedRequest into a ClassifyRequest/GenerateRequest, stamps send, chunk and
completion times, and turns replies (timings, ttft, status codes) into Outcomes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from loadtest.payloads import ImagePayload, TextPayload
from loadtest.records import OK, STREAM_GAP, STREAM_TRUNCATED, Outcome, StageSample
from loadtest.runner import Clock, MonotonicClock
from loadtest.scenario import ImageEncoding
from loadtest.targets.base import TargetError, TraceIds, request_start_value
from loadtest.workload import PlannedRequest

_CHANNEL_OPTIONS = [
    # Separate channels get separate connections, so num_channels spreads load over several
    # HTTP/2 connections instead of multiplexing every stream over one.
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # The harness measures; it must never retry behind the report's back.
    ("grpc.enable_retries", 0),
]


def grpc_channel(target: str, ca_file: str) -> grpc.aio.Channel:
    if not ca_file:
        return grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
    try:
        with open(ca_file, "rb") as f:
            ca_pem = f.read()
    except OSError as err:
        raise ValueError(f"cannot read the CA file {ca_file}: {err.strerror}") from None
    # Tenants bring an API key, not a client certificate: only the server is verified.
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca_pem), options=_CHANNEL_OPTIONS)


@dataclass(frozen=True)
class ModelStatus:
    name: str
    version: str
    kind: str  # "classifier" / "generator"
    ready: bool


class GatewayClient:
    def __init__(self, target: str, clock: Clock | None = None, num_channels: int = 1, run_id: str = "lt",
                 ca_file: str = "") -> None:
        """ca_file: a PEM CA bundle to verify the gateway's TLS certificate with; empty: plaintext."""
        if num_channels < 1:
            raise ValueError(f"num_channels must be >= 1, got {num_channels}")
        self._clock = clock or MonotonicClock()
        self._channels = [grpc_channel(target, ca_file) for _ in range(num_channels)]
        self._stubs = itertools.cycle([gateway_pb2_grpc.InferenceStub(c) for c in self._channels])
        self._images: dict[int, common_pb2.Image] = {}
        self._run_id = run_id
        self._traces = TraceIds()

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def list_models(self, api_key: str, timeout_s: float = 5.0) -> list[ModelStatus]:
        reply = await next(self._stubs).ListModels(
            gateway_pb2.ListModelsRequest(), metadata=_auth(api_key), timeout=timeout_s)
        return [
            ModelStatus(m.model.name, m.model.version,
                        common_pb2.ModelKind.Name(m.kind).removeprefix("MODEL_KIND_").lower(), m.ready)
            for m in reply.models
        ]

    async def ready_models(self, models: Iterable[str], api_key: str, timeout_s: float) -> set[str]:
        try:
            listed = await self.list_models(api_key, timeout_s)
        except grpc.aio.AioRpcError as err:
            raise TargetError(f"ListModels failed: {err.code().name}: {err.details()}") from None
        ready = {m.name for m in listed if m.ready}
        return {m for m in models if m in ready}

    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome:
        trace = self._traces.for_request(request.seq)
        metadata = _send_metadata(request.tenant.api_key, trace.traceparent)
        if isinstance(request.payload, TextPayload):
            outcome = await self._generate(request, request.payload, metadata, timeout_s)
        else:  # open_target refuses tensor classes for this kind
            outcome = await self._classify(request, metadata, timeout_s)
        return dataclasses.replace(outcome, trace_id=trace.trace_id)

    async def _classify(self, request: PlannedRequest, metadata: tuple[tuple[str, str], ...],
                        timeout_s: float | None) -> Outcome:
        c = request.request_class
        message = gateway_pb2.ClassifyRequest(
            model=common_pb2.ModelRef(name=c.model, version=c.version),
            image=self._image(request),
            top_k=c.top_k,
            request_id=f"{self._run_id}-{request.seq}",
        )
        sent_s = self._clock.now_s()
        try:
            reply = await next(self._stubs).Classify(message, metadata=metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, sent_s, self._clock.now_s(), err.details() or "")
        done_s = self._clock.now_s()
        return Outcome(OK, sent_s, done_s, stages=_stages(reply.timings), server_total_us=reply.timings.total_us)

    async def _generate(self, request: PlannedRequest, payload: TextPayload, metadata: tuple[tuple[str, str], ...],
                        timeout_s: float | None) -> Outcome:
        c = request.request_class
        message = gateway_pb2.GenerateRequest(
            model=common_pb2.ModelRef(name=c.model, version=c.version),
            prompt=payload.prompt,
            sampling=common_pb2.SamplingParams(
                max_tokens=payload.max_tokens, temperature=c.temperature, ignore_eos=c.ignore_eos,
                seed=request.seq),
            request_id=f"{self._run_id}-{request.seq}",
        )
        chunk_times_s: list[float] = []
        texts: list[str] = []
        num_tokens = 0
        last: gateway_pb2.GenerateResponse | None = None
        sent_s = self._clock.now_s()
        call = next(self._stubs).Generate(message, metadata=metadata, timeout=timeout_s)
        try:
            async for chunk in call:
                now_s = self._clock.now_s()
                if chunk.token_ids:
                    if chunk.index != num_tokens:
                        call.cancel()
                        return Outcome(STREAM_GAP, sent_s, now_s, f"chunk index {chunk.index}, expected {num_tokens}",
                                       chunk_times_s=tuple(chunk_times_s), num_output_tokens=num_tokens)
                    chunk_times_s.append(now_s)
                    num_tokens += len(chunk.token_ids)
                texts.append(chunk.text)
                if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    last = chunk
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, sent_s, self._clock.now_s(), err.details() or "",
                           chunk_times_s=tuple(chunk_times_s), num_output_tokens=num_tokens)
        done_s = self._clock.now_s()
        if last is None:
            return Outcome(STREAM_TRUNCATED, sent_s, done_s, "stream ended without a finish_reason",
                           chunk_times_s=tuple(chunk_times_s), num_output_tokens=num_tokens)
        return Outcome(OK, sent_s, done_s, stages=_stages(last.timings), server_total_us=last.timings.total_us,
                       server_ttft_us=last.ttft_us, chunk_times_s=tuple(chunk_times_s), num_output_tokens=num_tokens,
                       text="".join(texts))

    def _image(self, request: PlannedRequest) -> common_pb2.Image:
        cached = self._images.get(request.payload_key)
        if cached is None:
            assert isinstance(request.payload, ImagePayload)  # send() routes only images here
            cached = _image_message(request.payload)
            self._images[request.payload_key] = cached
        return cached


def _image_message(payload: ImagePayload) -> common_pb2.Image:
    if payload.encoding is ImageEncoding.PNG:
        return common_pb2.Image(encoded=payload.data)
    return common_pb2.Image(raw=common_pb2.RawImage(
        pixels=payload.data, height=payload.height, width=payload.width, channels=payload.channels))


def _auth(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def _send_metadata(api_key: str, traceparent: str) -> tuple[tuple[str, str], ...]:
    """Auth, `x-request-start` (the gateway reports the time the request waited before its handler
    ran as the `ingress` stage, so no wait goes unattributed) and the request's trace context."""
    return (("authorization", f"Bearer {api_key}"), ("x-request-start", request_start_value()),
            ("traceparent", traceparent))


def _stages(timings: common_pb2.Timings) -> tuple[StageSample, ...]:
    return tuple(StageSample(_stage_name(s.stage), s.service, s.duration_us) for s in timings.stages)


def _stage_name(value: int) -> str:
    try:
        return common_pb2.Stage.Name(value).removeprefix("STAGE_").lower()
    except ValueError:  # a stage added to the proto after this harness was built
        return f"stage_{value}"
