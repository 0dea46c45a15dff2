"""Helpers for tests that call the scheduler's own RPCs (Classify/Generate with a TenantContext,
GetPressure) on real processes started with tools.testbed.processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.processes import wait_until

CLASSIFIER = common_pb2.ModelRef(name="toy-classifier")
GENERATOR = common_pb2.ModelRef(name="toy-generator")
BRIGHT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))


@contextmanager
def scheduler_stub(address: str) -> Iterator[scheduler_pb2_grpc.SchedulerStub]:
    with session_tls.channel(address) as channel:
        yield scheduler_pb2_grpc.SchedulerStub(channel)


def tenant(tenant_id: str, priority: int = common_pb2.PRIORITY_STANDARD, weight: int = 1) -> scheduler_pb2.TenantContext:
    return scheduler_pb2.TenantContext(tenant_id=tenant_id, priority=priority, weight=weight)


def toy_continuation(prompt: str, num_tokens: int) -> str:
    """What the toy generator produces: each letter is followed by the next one, z by a."""
    out, last = [], prompt[-1]
    for _ in range(num_tokens):
        last = chr(ord("a") + (ord(last) - ord("a") + 1) % 26) if "a" <= last <= "z" else "a"
        out.append(last)
    return "".join(out)


def generate_request(prompt: str, max_tokens: int, who: str = "tests") -> scheduler_pb2.ScheduleGenerateRequest:
    return scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(
            model=GENERATOR, prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
        ),
        tenant=tenant(who),
    )


def classify_request(who: str, priority: int = common_pb2.PRIORITY_STANDARD) -> scheduler_pb2.ScheduleClassifyRequest:
    return scheduler_pb2.ScheduleClassifyRequest(
        request=gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), tenant=tenant(who, priority)
    )


@dataclass(frozen=True)
class StreamRecord:
    """What a client read from one Generate stream."""

    text: str
    indexes: list[int]  # index of each chunk that carried tokens
    num_tokens: int
    finish_reason: int

    def is_contiguous(self) -> bool:
        return self.indexes == sorted(self.indexes) and len(set(self.indexes)) == len(self.indexes)


def read_stream(call) -> StreamRecord:
    text, indexes, num_tokens, finish = [], [], 0, common_pb2.FINISH_REASON_UNSPECIFIED
    for response in call:
        chunk = response.chunk
        if chunk.token_ids:
            assert chunk.index == num_tokens, f"chunk at index {chunk.index}, expected {num_tokens}"
            indexes.append(chunk.index)
            num_tokens += len(chunk.token_ids)
        text.append(chunk.text)
        finish = chunk.finish_reason or finish
    return StreamRecord("".join(text), indexes, num_tokens, finish)


def pressure_of(stub: scheduler_pb2_grpc.SchedulerStub, model: common_pb2.ModelRef) -> common_pb2.ModelPressure | None:
    reply = stub.GetPressure(scheduler_pb2.GetPressureRequest(models=[model]), timeout=5)
    return reply.models[0] if reply.models else None


def wait_for_workers(stub, model: common_pb2.ModelRef, num_workers: int, timeout_s: float = 15.0) -> None:
    def attached() -> bool:
        pressure = pressure_of(stub, model)
        return pressure is not None and pressure.num_workers == num_workers

    wait_until(attached, timeout_s=timeout_s, message=f"{num_workers} workers of {model.name} attached")


def wait_for_idle_kv(stub, model: common_pb2.ModelRef, timeout_s: float = 5.0) -> float:
    """Waits until no KV block of the model is in use and nothing waits; returns the seconds it took."""
    began = time.monotonic()

    def idle() -> bool:
        pressure = pressure_of(stub, model)
        return pressure is not None and pressure.kv_usage == 0 and pressure.queue_depth == 0

    wait_until(idle, timeout_s=timeout_s, interval_s=0.01, message=f"KV blocks of {model.name} all free")
    return time.monotonic() - began
