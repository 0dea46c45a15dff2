"""A closed loop of toy-classifier Classify calls through a gateway: what bench_gateway and
bench_upstream drive it with."""

from __future__ import annotations

import asyncio
import time

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

REQUEST = gateway_pb2.ClassifyRequest(
    model=common_pb2.ModelRef(name="toy-classifier"),
    image=common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3)),
)


async def drive(address: str, api_key: str, num_requests: int, concurrency: int) -> tuple[dict[str, int], float]:
    """`num_requests` Classify calls, `concurrency` at a time: how many ended with each status code,
    and the wall time they took."""
    metadata = (("authorization", f"Bearer {api_key}"),)
    async with grpc.aio.insecure_channel(address) as channel:
        began = time.perf_counter()
        codes = await classify_codes(channel, metadata, num_requests, concurrency)
        return codes, time.perf_counter() - began


async def classify_codes(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], num_requests: int,
                         concurrency: int) -> dict[str, int]:
    """`num_requests` Classify calls on `channel`, `concurrency` at a time: how many ended with each
    status code."""
    stub = gateway_pb2_grpc.InferenceStub(channel)
    codes: dict[str, int] = {}
    remaining = num_requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            try:
                await stub.Classify(REQUEST, timeout=10, metadata=metadata)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
            codes[code] = codes.get(code, 0) + 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return codes
