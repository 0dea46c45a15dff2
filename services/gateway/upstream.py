"""The gateway's client of a scheduler endpoint; upstream statuses come back as domain errors."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from infermesh.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.status import from_rpc_error
from services.common.telemetry import metadata_for


class SchedulerClient:
    def __init__(self, address: str, max_message_bytes: int) -> None:
        self.address = address
        self._channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
            ],
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)

    async def classify(
        self, request: scheduler_pb2.ScheduleClassifyRequest, timeout_s: float
    ) -> gateway_pb2.ClassifyResponse:
        try:
            reply = await self._stub.Classify(request, timeout=timeout_s, metadata=metadata_for())
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        return reply.response

    async def generate(
        self, request: scheduler_pb2.ScheduleGenerateRequest, timeout_s: float
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        call = self._stub.Generate(request, timeout=timeout_s, metadata=metadata_for())
        try:
            async for reply in call:
                yield reply.chunk
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()  # the client went away: the scheduler aborts the sequence and frees its blocks

    async def list_models(self, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        try:
            return await self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def close(self) -> None:
        await self._channel.close()
