"""The gateway's clients of scheduler endpoints.

A failed call raises `AttemptError`: the domain error the client would see
(code, message and retry hint kept by `from_rpc_error`) plus what the retry
policy and the circuit breaker need (the raw status code, the server's
pushback, whether the scheduler's handler answered).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from infermesh.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.errors import InfermeshError
from services.common.status import PUSHBACK_KEY, from_rpc_error
from services.common.telemetry import metadata_for
from services.gateway.upstream_status import UpstreamCode

# A restarted scheduler must be found again within about a second, not after gRPC's
# default reconnect backoff (up to 120 s).
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class AttemptError(Exception):
    """One upstream call failed; `error` is what the caller gets unless the gateway retries."""

    def __init__(self, error: InfermeshError, code: UpstreamCode, pushback_ms: int | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.code = code
        # `grpc-retry-pushback-ms` as sent (negative: do not retry); None when absent.
        self.pushback_ms = pushback_ms

    @property
    def answered_by_scheduler(self) -> bool:
        """The scheduler itself refused with a retry hint (e.g. no worker for this model).

        It is up and talking, so for its circuit breaker this is not a failure, unlike a
        connection refused or reset, which carries no hint.
        """
        return self.pushback_ms is not None

    @classmethod
    def from_rpc_error(cls, exc: grpc.aio.AioRpcError) -> AttemptError:
        return cls(from_rpc_error(exc), UpstreamCode(exc.code().value[0]), _pushback_ms(exc))


def _pushback_ms(exc: grpc.aio.AioRpcError) -> int | None:
    for key, value in exc.trailing_metadata() or ():
        if key == PUSHBACK_KEY:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


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
    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                *_RECONNECT_OPTIONS,
            ],
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def classify(
        self, request: scheduler_pb2.ScheduleClassifyRequest, timeout_s: float
    ) -> gateway_pb2.ClassifyResponse:
        try:
            reply = await self._stub.Classify(request, timeout=timeout_s, metadata=metadata_for())
        except grpc.aio.AioRpcError as exc:
            raise AttemptError.from_rpc_error(exc) from None
        return reply.response

    def generate(self, request: scheduler_pb2.ScheduleGenerateRequest, timeout_s: float) -> GenerateCall:
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
        await self._channel.close()


class SchedulerClients:
    """One client (channel) per scheduler endpoint, made on first use."""

    def __init__(self, max_message_bytes: int) -> None:
        self._max_message_bytes = max_message_bytes
        self._by_address: dict[str, SchedulerClient] = {}

    def get(self, address: str) -> SchedulerClient:
        client = self._by_address.get(address)
        if client is None:
            client = self._by_address[address] = SchedulerClient(address, self._max_message_bytes)
        return client

    async def close(self) -> None:
        for client in self._by_address.values():
            await client.close()
        self._by_address.clear()
