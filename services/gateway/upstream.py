"""The gateway's clients of scheduler endpoints.

Classify and Generate go upstream one of two ways, with the same interface and
errors: as entries on one long-lived Submit stream per endpoint
(`UpstreamMode.STREAM`, scheduler_stream.py) or as a unary/server-streaming RPC
each (`UpstreamMode.UNARY`). A failed call raises `AttemptError`
(attempt_error.py): the domain error the client would see plus what the retry
policy and the circuit breaker need.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator

import grpc

from infermesh.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.telemetry import carrier_for, metadata_for
from services.gateway.attempt_error import AttemptError
from services.gateway.scheduler_stream import SchedulerStream, StreamGenerateCall

__all__ = ["AttemptError", "GenerateCall", "SchedulerClient", "SchedulerClients", "UpstreamMode"]

# A restarted scheduler must be found again within about a second, not after gRPC's
# default reconnect backoff (up to 120 s).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


_SUBMIT_METHOD = f"/{scheduler_pb2.DESCRIPTOR.services_by_name['Scheduler'].full_name}/Submit"


class UpstreamMode(enum.Enum):
    # One Submit stream per scheduler endpoint, many calls per message.
    STREAM = "stream"
    # One RPC per call (Classify unary, Generate server-streaming).
    UNARY = "unary"


class GenerateCall:
    """One upstream Generate stream: iterate for chunks; `cancel()` when abandoning it."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    async def chunks(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            async for reply in self._call:
                yield reply.chunk
        except grpc.aio.AioRpcError as exc:
            raise AttemptError.from_rpc_error(exc) from None

    def cancel(self) -> None:
        # The scheduler aborts the sequence and frees its KV blocks within one step.
        self._call.cancel()


class SchedulerClient:
    def __init__(self, address: str, max_message_bytes: int, mode: UpstreamMode = UpstreamMode.STREAM) -> None:
        self.address = address
        self.mode = mode
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                *_RECONNECT_OPTIONS,
            ],
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._stream = None
        if mode is UpstreamMode.STREAM:
            # Requests go out as SubmitBatch bytes encoded by submit_outbox.py (no serializer here).
            open_submit = self._channel.stream_stream(
                _SUBMIT_METHOD, request_serializer=None, response_deserializer=scheduler_pb2.ReplyBatch.FromString
            )
            self._stream = SchedulerStream(address, open_submit, max_message_bytes)

    async def classify(
        self, request: scheduler_pb2.ScheduleClassifyRequest, timeout_s: float
    ) -> gateway_pb2.ClassifyResponse:
        if self._stream is not None:
            # The entry carries the attempt's trace context, as the unary call's metadata does.
            return await self._stream.classify(request, timeout_s, carrier_for())
        try:
            reply = await self._stub.Classify(request, timeout=timeout_s, metadata=metadata_for())
        except grpc.aio.AioRpcError as exc:
            raise AttemptError.from_rpc_error(exc) from None
        return reply.response

    def generate(self, request: scheduler_pb2.ScheduleGenerateRequest,
                 timeout_s: float) -> GenerateCall | StreamGenerateCall:
        if self._stream is not None:
            return self._stream.generate(request, timeout_s, carrier_for())
        return GenerateCall(self._stub.Generate(request, timeout=timeout_s, metadata=metadata_for()))

    async def list_models(self, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        try:
            return await self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise AttemptError.from_rpc_error(exc) from None

    async def get_pressure(self, timeout_s: float) -> scheduler_pb2.GetPressureResponse:
        try:
            return await self._stub.GetPressure(scheduler_pb2.GetPressureRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise AttemptError.from_rpc_error(exc) from None

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
        await self._channel.close()


class SchedulerClients:
    """One client (channel, and Submit stream in stream mode) per scheduler endpoint, made on first use."""

    def __init__(self, max_message_bytes: int, mode: UpstreamMode = UpstreamMode.STREAM) -> None:
        self._max_message_bytes = max_message_bytes
        self._mode = mode
        self._by_address: dict[str, SchedulerClient] = {}

    def get(self, address: str) -> SchedulerClient:
        client = self._by_address.get(address)
        if client is None:
            client = self._by_address[address] = SchedulerClient(address, self._max_message_bytes, self._mode)
        return client

    async def retire(self, address: str) -> None:
        """Closes `address`'s client (it left discovery); a later `get` makes a new one."""
        client = self._by_address.pop(address, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        for client in self._by_address.values():
            await client.close()
        self._by_address.clear()
