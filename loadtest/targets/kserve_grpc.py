"""The Target over KServe v2 gRPC (inference.GRPCInferenceService): ModelInfer for classify and tensor
classes (inputs in raw_input_contents, as tritonclient sends them), ModelStreamInfer (Triton's decoupled streaming) for generate classes, one stream per request so a
request's latency never waits on another's.

KServe replies carry no stage timings, so runs against this kind have no stage columns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import grpc

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from loadtest.payloads import ImagePayload, TensorPayload, TextPayload
from loadtest.records import OK, STREAM_TRUNCATED, Outcome
from loadtest.runner import Clock, MonotonicClock
from loadtest.targets import kserve_tensors
from loadtest.targets.base import TargetError, TraceIds, request_start_value
from loadtest.targets.infermesh_grpc import grpc_channel
from loadtest.targets.token_count import TokenCounter
from loadtest.workload import PlannedRequest

BAD_REPLY = "BAD_REPLY"


class KServeGrpcTarget:
    def __init__(self, host_port: str, counter: TokenCounter, clock: Clock | None = None, run_id: str = "lt",
                 ca_file: str = "") -> None:
        self._channel = grpc_channel(host_port, ca_file)
        self._stub = kserve_grpc.GRPCInferenceServiceStub(self._channel)
        self._counter = counter
        self._clock = clock or MonotonicClock()
        self._run_id = run_id
        self._requests: dict[int, kserve.ModelInferRequest] = {}  # by payload_key
        self._traces = TraceIds()

    async def close(self) -> None:
        await self._channel.close()

    async def ready_models(self, models: Iterable[str], api_key: str, timeout_s: float) -> set[str]:
        ready = set()
        for name in models:
            try:
                reply = await self._stub.ModelReady(kserve.ModelReadyRequest(name=name), metadata=_auth(api_key),
                                                    timeout=timeout_s)
            except grpc.aio.AioRpcError as err:
                if err.code() is grpc.StatusCode.NOT_FOUND:
                    continue
                raise TargetError(f"ModelReady({name}) failed: {err.code().name}: {err.details()}") from None
            if reply.ready:
                ready.add(name)
        return ready

    async def send(self, request: PlannedRequest, timeout_s: float | None) -> Outcome:
        trace = self._traces.for_request(request.seq)
        metadata = _metadata(request, trace.traceparent)
        if isinstance(request.payload, TextPayload):
            outcome = await self._stream(request, request.payload, metadata, timeout_s)
        else:
            outcome = await self._infer(request, metadata, timeout_s)
        return dataclasses.replace(outcome, trace_id=trace.trace_id)

    async def _infer(self, request: PlannedRequest, metadata: tuple[tuple[str, str], ...],
                     timeout_s: float | None) -> Outcome:
        message = kserve.ModelInferRequest()
        message.CopyFrom(self._infer_request(request))
        message.id = f"{self._run_id}-{request.seq}"
        sent_s = self._clock.now_s()
        try:
            await self._stub.ModelInfer(message, metadata=metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, sent_s, self._clock.now_s(), err.details() or "")
        return Outcome(OK, sent_s, self._clock.now_s())

    async def _stream(self, request: PlannedRequest, payload: TextPayload, metadata: tuple[tuple[str, str], ...],
                      timeout_s: float | None) -> Outcome:
        message = _text_request(request, payload, f"{self._run_id}-{request.seq}")
        chunk_times_s: list[float] = []
        texts: list[bytes] = []
        usage_tokens: int | None = None
        sent_s = self._clock.now_s()
        call = self._stub.ModelStreamInfer(metadata=metadata, timeout=timeout_s)
        try:
            await call.write(message)
            await call.done_writing()
            async for reply in call:
                now_s = self._clock.now_s()
                if reply.error_message:
                    status = reply.infer_response.parameters["status"].string_param or "STREAM_ERROR"
                    return Outcome(status, sent_s, now_s, reply.error_message, chunk_times_s=tuple(chunk_times_s),
                                   num_output_tokens=self._count(texts))
                response = reply.infer_response
                try:
                    text = b"".join(kserve_tensors.unpack_bytes(response.raw_output_contents[0])) \
                        if response.raw_output_contents else b""
                except ValueError as err:
                    call.cancel()
                    return Outcome(BAD_REPLY, sent_s, now_s, str(err), chunk_times_s=tuple(chunk_times_s))
                if text:
                    chunk_times_s.append(now_s)
                    texts.append(text)
                parameters = response.parameters
                if "completion_tokens" in parameters:
                    usage_tokens = parameters["completion_tokens"].int64_param
                if parameters[kserve_tensors.FINAL].bool_param:
                    call.cancel()  # the request is answered; the stream has nothing more for us
                    return Outcome(OK, sent_s, now_s, chunk_times_s=tuple(chunk_times_s),
                                   num_output_tokens=self._count(texts) if usage_tokens is None else usage_tokens,
                                   text=b"".join(texts).decode("utf-8", "replace"))
        except grpc.aio.AioRpcError as err:
            return Outcome(err.code().name, sent_s, self._clock.now_s(), err.details() or "",
                           chunk_times_s=tuple(chunk_times_s), num_output_tokens=self._count(texts))
        return Outcome(STREAM_TRUNCATED, sent_s, self._clock.now_s(), f"stream ended without {kserve_tensors.FINAL}",
                       chunk_times_s=tuple(chunk_times_s), num_output_tokens=self._count(texts))

    def _count(self, texts: list[bytes]) -> int:
        return self._counter.count(b"".join(texts).decode("utf-8", "replace"))

    def _infer_request(self, request: PlannedRequest) -> kserve.ModelInferRequest:
        """Built once per payload (an image, or a tensor class's variant) and copied per request."""
        cached = self._requests.get(request.payload_key)
        if cached is None:
            assert isinstance(request.payload, ImagePayload | TensorPayload)  # send() routes only these here
            cached = infer_request(request.request_class.model, request.request_class.version, request.payload)
            self._requests[request.payload_key] = cached
        return cached


def infer_request(model: str, version: str, payload: ImagePayload | TensorPayload) -> kserve.ModelInferRequest:
    """A ModelInfer request (no id) carrying the payload's inputs in raw_input_contents."""
    message = kserve.ModelInferRequest(model_name=model, model_version=version)
    for tensor in kserve_tensors.request_tensors(payload):
        message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
        message.raw_input_contents.append(tensor.raw)
    return message


def _text_request(request: PlannedRequest, payload: TextPayload, request_id: str) -> kserve.ModelInferRequest:
    c = request.request_class
    tensor = kserve_tensors.text_tensor(payload.prompt)
    message = kserve.ModelInferRequest(model_name=c.model, model_version=c.version, id=request_id)
    message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=list(tensor.shape))
    message.raw_input_contents.append(tensor.raw)
    message.parameters["max_tokens"].int64_param = payload.max_tokens
    message.parameters["temperature"].double_param = c.temperature
    message.parameters["seed"].int64_param = request.seq
    message.parameters["ignore_eos"].bool_param = c.ignore_eos
    return message


def _auth(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def _metadata(request: PlannedRequest, traceparent: str) -> tuple[tuple[str, str], ...]:
    return (*_auth(request.tenant.api_key), ("x-request-start", request_start_value()), ("traceparent", traceparent))
