"""Closed-loop drivers for the token fast path benchmark: the scheduler's Submit stream, the gateway.

drive_submit: `num_streams` Generate calls are kept open on one Submit stream, as a gateway would hold them:
when a call's last chunk (or an error) arrives, the next call goes out in the same turn, all new
entries of a turn in one SubmitBatch. Replies are parsed (ReplyBatch) and only token ids are
counted, so the client spends as little as it can per token; its CPU is measured anyway, since
it shares the machine's cores with the scheduler.

drive_gateway: `num_streams` Inference/Generate calls at a gateway, each followed by the next
when it ends; chunks are parsed only to count their token ids.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc

GENERATE_METHOD = "/infermesh.v1.Inference/Generate"

CALL_TIMEOUT_US = 120_000_000


@dataclass(frozen=True)
class SubmitWindow:
    """What one measured window of the driver saw."""

    window_s: float
    num_tokens: int  # token ids delivered to this client in the window
    num_completed: int  # calls that ended with their last chunk in the window
    num_short: int  # completed calls that got fewer tokens than max_tokens (should be 0)
    num_errors: int  # CallErrors in the window
    # By status code name, and the first error's message: a run that only failed says why.
    error_codes: dict[str, int] = field(default_factory=dict)
    first_error: str = ""


def generate_entry(call_id: int, model: str, prompt: str, max_tokens: int) -> scheduler_pb2.SubmitEntry:
    request = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=model), prompt=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tenant = scheduler_pb2.TenantContext(tenant_id="bench", priority=common_pb2.PRIORITY_STANDARD, weight=1)
    return scheduler_pb2.SubmitEntry(call_id=call_id, timeout_us=CALL_TIMEOUT_US,
                                     generate=scheduler_pb2.ScheduleGenerateRequest(request=request, tenant=tenant))


async def drive_submit(address: str, model: str, num_streams: int, max_tokens: int, warmup_s: float,
                       window_s: float, on_window_start=None) -> SubmitWindow:
    """Runs the closed loop for warmup_s + window_s; counts only the window. `on_window_start()` is
    called when the window opens and its return value's `__call__` when it closes (CPU readings)."""
    call_ids = itertools.count(1)
    tokens_by_call: dict[int, int] = {}
    counts = {"tokens": 0, "completed": 0, "short": 0, "errors": 0}
    codes: Counter[str] = Counter()
    messages: list[str] = []
    measuring = False

    def next_entries(num: int) -> scheduler_pb2.SubmitBatch:
        entries = []
        for _ in range(num):
            call_id = next(call_ids)
            tokens_by_call[call_id] = 0
            entries.append(generate_entry(call_id, model, f"stream {call_id} of the bench ", max_tokens))
        return scheduler_pb2.SubmitBatch(entries=entries)

    async with grpc.aio.insecure_channel(address) as channel:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Submit()
        await call.write(next_entries(num_streams))

        async def read() -> None:
            async for batch in call:
                num_ended = 0
                for reply in batch.replies:
                    kind = reply.WhichOneof("kind")
                    if kind == "chunk":
                        n = len(reply.chunk.token_ids)
                        tokens_by_call[reply.call_id] += n
                        if measuring:
                            counts["tokens"] += n
                        if reply.chunk.finish_reason:
                            num_ended += 1
                            got = tokens_by_call.pop(reply.call_id)
                            if measuring:
                                counts["completed"] += 1
                                counts["short"] += got < max_tokens
                    elif kind == "error":
                        num_ended += 1
                        tokens_by_call.pop(reply.call_id, None)
                        if measuring:
                            counts["errors"] += 1
                            codes[_code_name(reply.error.code)] += 1
                            messages.append(reply.error.message)
                if num_ended:
                    await call.write(next_entries(num_ended))

        reader = asyncio.create_task(read())
        await asyncio.sleep(warmup_s)
        closing = on_window_start() if on_window_start else None
        measuring = True
        began_s = time.perf_counter()
        await asyncio.sleep(window_s)
        measuring = False
        measured_s = time.perf_counter() - began_s
        if closing:
            closing()
        reader.cancel()
        call.cancel()
    return SubmitWindow(measured_s, counts["tokens"], counts["completed"], counts["short"], counts["errors"],
                        dict(codes), messages[0] if messages else "")


async def drive_gateway(address: str, model: str, num_streams: int, max_tokens: int, warmup_s: float,
                        window_s: float, on_window_start=None, max_tokens_per_chunk: int = 0) -> SubmitWindow:
    """Like drive_submit, through a gateway's public Generate (errors: failed calls).
    max_tokens_per_chunk > 0 asks for stream coalescing (GenerateRequest.stream)."""
    counts = {"tokens": 0, "completed": 0, "short": 0, "errors": 0}
    codes: Counter[str] = Counter()
    messages: list[str] = []
    measuring = False
    stop = False
    body = gateway_pb2.GenerateRequest(
        model=common_pb2.ModelRef(name=model), prompt="a stream through the gateway ",
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        stream=gateway_pb2.StreamOptions(max_tokens_per_chunk=max_tokens_per_chunk)).SerializeToString()
    parse = gateway_pb2.GenerateResponse.FromString

    async with grpc.aio.insecure_channel(address) as channel:
        generate = channel.unary_stream(GENERATE_METHOD)

        async def client() -> None:
            while not stop:
                got = 0
                try:
                    async for raw in generate(body, timeout=CALL_TIMEOUT_US / 1e6):
                        n = len(parse(raw).token_ids)
                        got += n
                        if measuring:
                            counts["tokens"] += n
                except grpc.aio.AioRpcError as exc:
                    if measuring:
                        counts["errors"] += 1
                        codes[exc.code().name] += 1
                        messages.append(exc.details() or "")
                    continue
                if measuring:
                    counts["completed"] += 1
                    counts["short"] += got < max_tokens

        clients = [asyncio.create_task(client()) for _ in range(num_streams)]
        await asyncio.sleep(warmup_s)
        closing = on_window_start() if on_window_start else None
        measuring = True
        began_s = time.perf_counter()
        await asyncio.sleep(window_s)
        measuring = False
        measured_s = time.perf_counter() - began_s
        if closing:
            closing()
        stop = True
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    return SubmitWindow(measured_s, counts["tokens"], counts["completed"], counts["short"], counts["errors"],
                        dict(codes), messages[0] if messages else "")


def _code_name(value: int) -> str:
    """The name of a numeric gRPC status code."""
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), f"code {value}")
