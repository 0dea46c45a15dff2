"""The gateway's clients of scheduler endpoints.

Classify and Generate go upstream one of two ways, with the same interface and
errors: as entries on one long-lived Submit stream per endpoint
(`UpstreamMode.STREAM`, scheduler_stream.py) or as a unary/server-streaming RPC
each (`UpstreamMode.UNARY`). A failed call raises `AttemptError`
(attempt_error.py): the domain error the client would see plus what the retry
policy and the circuit breaker need.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable

import grpc

from infermesh.v1 import gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common import tls
from services.common.telemetry import carrier_for, metadata_for
from services.gateway.upstream.attempt_error import AttemptError
from services.gateway.upstream.scheduler_stream import SchedulerStream, StreamGenerateCall
from services.gateway.upstream.status import UpstreamCode

__all__ = ["AttemptError", "GenerateCall", "SchedulerClient", "SchedulerClients", "UpstreamMode"]

# A restarted scheduler must be found again within a second of its start, not after gRPC's
# default reconnect backoff (up to 120 s). gRPC jitters each wait by +-20%, so a 1 s cap put the
# re-dial up to 1.2 s after the scheduler listened; at 250 ms a dead endpoint costs ~4 dials a second.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 250),
]


_SUBMIT_METHOD = f"/{scheduler_pb2.DESCRIPTOR.services_by_name['Scheduler'].full_name}/Submit"


class UpstreamMode(enum.Enum):
    # One Submit stream per scheduler endpoint, many calls per message.
    STREAM = "stream"
    # One RPC per call (Classify unary, Generate server-streaming).
    UNARY = "unary"


class GenerateCall:
    """One upstream Generate stream: iterate for chunks; `cancel()` when abandoning it."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, calls: UnaryCalls) -> None:
        self._call = call
        self._calls = calls

    async def chunks(self) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            async for reply in self._call:
                self._calls.heard()
                yield reply.chunk
        except grpc.aio.AioRpcError as exc:
            raise self._calls.error(self._call, exc) from None
        except asyncio.CancelledError:
            severed = self._calls.severed(self._call)
            if severed is None:
                raise  # the client went away
            raise severed from None
        finally:
            self._calls.done(self._call)

    def cancel(self) -> None:
        # The scheduler aborts the sequence and frees its KV blocks within one step.
        self._calls.done(self._call)
        self._call.cancel()


class UnaryCalls:
    """A unary-mode client's calls in flight, so a silent scheduler's can be severed (see `sever`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # call -> why it was severed (None while it runs)
        self._calls: dict[grpc.aio.Call, str | None] = {}
        self._heard_at_s = clock()

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call: grpc.aio.Call) -> grpc.aio.Call:
        if not self._calls:
            self._heard_at_s = self._clock()  # silence counts from when there is something to hear
        self._calls[call] = None
        return call

    def done(self, call: grpc.aio.Call) -> None:
        self._calls.pop(call, None)

    def heard(self) -> None:
        self._heard_at_s = self._clock()

    def silent_for_s(self) -> float:
        return self._clock() - self._heard_at_s

    def sever(self, why: str) -> int:
        calls = list(self._calls)
        for call in calls:
            self._calls[call] = why
            call.cancel()
        return len(calls)

    def error(self, call: grpc.aio.Call, exc: grpc.aio.AioRpcError) -> AttemptError:
        why = self._calls.get(call)
        if why is not None:  # cancelled here by sever(), not by the scheduler
            return AttemptError.local(UpstreamCode.UNAVAILABLE, why, scheduler_silent=True)
        return AttemptError.from_rpc_error(exc)

    def severed(self, call: grpc.aio.Call) -> AttemptError | None:
        """For a call that ended cancelled: the AttemptError if sever() cancelled it, else None."""
        why = self._calls.get(call)
        return None if why is None else AttemptError.local(UpstreamCode.UNAVAILABLE, why, scheduler_silent=True)


class SchedulerClient:
    def __init__(self, address: str, max_message_bytes: int, mode: UpstreamMode = UpstreamMode.STREAM) -> None:
        self.address = address
        self.mode = mode
        # mTLS with the gateway's certificate when --tls-* is set (services/common/tls.py), else plaintext.
        self._channel = tls.aio_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                *_RECONNECT_OPTIONS,
            ],
        )
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._stream = None
        self._unary_calls = UnaryCalls()
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
        call = self._unary_calls.add(self._stub.Classify(request, timeout=timeout_s, metadata=metadata_for()))
        try:
            reply = await call
        except grpc.aio.AioRpcError as exc:
            raise self._unary_calls.error(call, exc) from None
        except asyncio.CancelledError:
            severed = self._unary_calls.severed(call)
            if severed is None:
                raise  # the client went away
            raise severed from None
        finally:
            self._unary_calls.done(call)
        self._unary_calls.heard()
        return reply.response

    def generate(self, request: scheduler_pb2.ScheduleGenerateRequest,
                 timeout_s: float) -> GenerateCall | StreamGenerateCall:
        if self._stream is not None:
            return self._stream.generate(request, timeout_s, carrier_for())
        call = self._unary_calls.add(self._stub.Generate(request, timeout=timeout_s, metadata=metadata_for()))
        return GenerateCall(call, self._unary_calls)

    def is_silent(self, silent_s: float) -> bool:
        """Calls wait on the scheduler and it has sent nothing for `silent_s`."""
        if self._stream is not None:
            return self._stream.num_calls > 0 and self._stream.silent_for_s() >= silent_s
        return len(self._unary_calls) > 0 and self._unary_calls.silent_for_s() >= silent_s

    def sever_if_silent(self, silent_s: float, why: str) -> int:
        """Fails every call in flight with UNAVAILABLE (no pushback) when the scheduler has sent
        nothing for `silent_s` while calls waited on it; returns how many.

        The pressure poller calls this when a poll timed out: a scheduler cut off the network
        resets nothing, so its calls would otherwise wait for their deadlines, and the
        dispatcher fails them over (classify) or resumes them (streams) instead. A scheduler
        that is slow but still sending keeps its calls."""
        if not self.is_silent(silent_s):
            return 0
        if self._stream is not None:
            return self._stream.sever(why)
        return self._unary_calls.sever(why)

    async def list_models(self, timeout_s: float) -> gateway_pb2.ListModelsResponse:
        return await _unary(self._stub.ListModels, gateway_pb2.ListModelsRequest(), timeout_s)

    async def tokenize(self, request: gateway_pb2.TokenizeRequest, timeout_s: float) -> gateway_pb2.TokenizeResponse:
        return await _unary(self._stub.Tokenize, request, timeout_s)

    async def detokenize(self, request: gateway_pb2.DetokenizeRequest,
                         timeout_s: float) -> gateway_pb2.DetokenizeResponse:
        return await _unary(self._stub.Detokenize, request, timeout_s)

    async def tokenizer_info(self, request: gateway_pb2.GetTokenizerInfoRequest,
                             timeout_s: float) -> gateway_pb2.GetTokenizerInfoResponse:
        return await _unary(self._stub.GetTokenizerInfo, request, timeout_s)

    async def get_pressure(self, timeout_s: float) -> scheduler_pb2.GetPressureResponse:
        return await _unary(self._stub.GetPressure, scheduler_pb2.GetPressureRequest(), timeout_s)

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

    def clients(self) -> list[SchedulerClient]:
        """Every client made so far."""
        return list(self._by_address.values())

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


async def _unary(method, request, timeout_s: float):
    """A unary scheduler call outside the dispatcher (listing, tokenizing, pressure polls): an RPC error as an
    AttemptError."""
    try:
        return await method(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        raise AttemptError.from_rpc_error(exc) from None
