"""Reflection-driven fuzzing of a gRPC port: every method the server lists, hostile requests built
from its descriptors, sent as raw bytes so nothing on the client side filters them.

A request is one of three kinds, drawn by a seeded RNG (the same seed sends the same bytes):
    raw:     random wire bytes;
    hostile: a structurally valid message with hostile field values (empty, huge, NaN/inf,
             extreme ints, unknown enum values, long repeated fields, nested messages), sometimes
             with a string field re-sent as invalid UTF-8;
    mutated: a hostile message with bytes flipped, inserted or cut;
    seeded:  a valid request the test supplies (as sent on a stream, else mutated), then hostile ones.
Client-streaming methods get a sequence of 0-5 such messages; server-streaming answers are read
to their end (at most 64 messages; one for a stream that never ends, like Health.Watch). The outcome of each call is its status code (OK included).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

MAX_STRING_CHARS = 4096
MAX_BYTES = 16 * 1024
MAX_REPEATED = 40
MAX_DEPTH = 4
KINDS = ("raw", "hostile", "hostile", "hostile", "mutated")  # drawn uniformly: most calls parse

# Values a real caller would send, so hostile messages also get past the first checks.
MODEL_NAMES = ("toy-classifier", "toy-generator")
# Streams that never end by design: one answer is enough.
ENDLESS_STREAMS = frozenset({"/grpc.health.v1.Health/Watch"})
PLAUSIBLE_STRINGS = ("toy-classifier", "toy-generator", "1", "FP32", "UINT8", "BYTES", "INT64", "BOOL", "FP16",
                     "input", "output", "image", "text", "IMAGE", "PROBABILITIES", "LABELS", "Bearer fuzz-key", "infermesh.v1.Scheduler")
HOSTILE_STRINGS = ("", " ", "\x00", "a" * MAX_STRING_CHARS, "ü😀\u202e\ufeff", "../../etc/passwd", "%s%n%x",
                   "\n\r\t", "{" * 200, "-1", "NaN", "1e309", "__other__", "_other")
_INT_BOUNDS = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}
_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308, 5e-324, 3.4e38, 1.0, -1.0, 0.5, 1e9)


@dataclass(frozen=True)
class Method:
    path: str  # /package.Service/Method
    input_type: Descriptor
    client_streaming: bool
    server_streaming: bool


def discover(channel: grpc.Channel) -> list[Method]:
    """Every method of every service the server's reflection lists."""
    database = ProtoReflectionDescriptorDatabase(channel)
    pool = descriptor_pool.DescriptorPool(database)
    methods = []
    for service_name in database.get_services():
        service = pool.FindServiceByName(service_name)
        methods.extend(_method(service_name, m) for m in service.methods)
    return methods


def _method(service_name: str, method: MethodDescriptor) -> Method:
    return Method(f"/{service_name}/{method.name}", method.input_type, method.client_streaming,
                  method.server_streaming)


class RequestMaker:
    """Hostile request bytes for a message type, from one seeded RNG."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def request(self, descriptor: Descriptor, kind: str) -> bytes:
        if kind == "raw":
            return self.raw()
        encoded = self.hostile(descriptor)
        return self.mutate(encoded) if kind == "mutated" else encoded

    def raw(self) -> bytes:
        size = self.rng.choice((0, 1, 2, 5, 17, 64, 300, 4096))
        return self.rng.randbytes(size)

    def mutate(self, data: bytes) -> bytes:
        buf = bytearray(data or b"\x00")
        for _ in range(self.rng.randint(1, 6)):
            at = self.rng.randrange(len(buf) + 1)
            action = self.rng.random()
            if action < 0.4 and at < len(buf):
                buf[at] ^= 1 << self.rng.randrange(8)
            elif action < 0.7:
                buf[at:at] = self.rng.randbytes(self.rng.randint(1, 8))
            elif action < 0.85:
                del buf[at:]
            else:
                buf[at:at] = _varint(self.rng.choice((2**31, 2**63, 2**64 - 1, 10**12)))
            if not buf:
                buf.append(self.rng.randrange(256))
        return bytes(buf)

    def hostile(self, descriptor: Descriptor) -> bytes:
        message = message_factory.GetMessageClass(descriptor)()
        self._fill(message, descriptor, depth=0)
        encoded = message.SerializeToString()
        strings = [f for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING]
        if strings and self.rng.random() < 0.1:
            # A string field that is not UTF-8: the protobuf runtime refuses to build it, the wire does not.
            target = self.rng.choice(strings)
            bad = self.rng.choice((b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80"))
            encoded += _varint(target.number << 3 | 2) + _varint(len(bad)) + bad
        return encoded

    def _fill(self, message, descriptor: Descriptor, depth: int) -> None:
        fields = list(descriptor.fields)
        if not fields:
            return
        # Dense messages get past the "x is required" checks into the handlers; sparse ones test those checks.
        density = self.rng.choice((0.3, 0.95, 1.0, 1.0))
        for fd in (f for f in fields if self.rng.random() < density):
            if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
                self._fill_map(getattr(message, fd.name), fd.message_type, depth)
            elif fd.is_repeated:
                self._fill_repeated(getattr(message, fd.name), fd, depth)
            elif fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                if depth < MAX_DEPTH:
                    self._fill(getattr(message, fd.name), fd.message_type, depth + 1)
                    getattr(message, fd.name).SetInParent()
            else:
                setattr(message, fd.name, self.scalar(fd))

    def _fill_repeated(self, container, fd: FieldDescriptor, depth: int) -> None:
        count = self.rng.choice((0, 1, 2, 3, 7, MAX_REPEATED))
        if fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            if depth >= MAX_DEPTH:
                return
            for _ in range(min(count, 8)):
                self._fill(container.add(), fd.message_type, depth + 1)
        else:
            container.extend(self.scalar(fd) for _ in range(count))

    def _fill_map(self, container, entry: Descriptor, depth: int) -> None:
        key_fd, value_fd = entry.fields_by_name["key"], entry.fields_by_name["value"]
        for _ in range(self.rng.choice((0, 1, 3, 8))):
            key = self.scalar(key_fd)
            if value_fd.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
                if depth < MAX_DEPTH:
                    self._fill(container[key], value_fd.message_type, depth + 1)
            else:
                container[key] = self.scalar(value_fd)

    def scalar(self, fd: FieldDescriptor):
        rng, cpp = self.rng, fd.cpp_type
        if cpp in _INT_BOUNDS:
            low, high = _INT_BOUNDS[cpp]
            return rng.choice((0, 1, low, high, max(low, -1), rng.randint(low, high), rng.randint(0, 64),
                               min(high, 10**9)))
        if cpp in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
            value = rng.choice((*_FLOATS, rng.uniform(-1e6, 1e6)))
            return value if cpp == FieldDescriptor.CPPTYPE_DOUBLE or not math.isfinite(value) or abs(value) < 3e38 \
                else math.inf
        if cpp == FieldDescriptor.CPPTYPE_BOOL:
            return rng.random() < 0.5
        if cpp == FieldDescriptor.CPPTYPE_ENUM:
            known = [v.number for v in fd.enum_type.values]
            return rng.choice((*known, -1, 99, 2**31 - 1, -(2**31)))  # proto3 enums keep unknown values
        if fd.type == FieldDescriptor.TYPE_BYTES:
            return self._bytes()
        if fd.name in ("name", "model_name") and rng.random() < 0.7:
            return rng.choice(MODEL_NAMES)  # past "no such model" into the handler
        if fd.name in ("version", "model_version") and rng.random() < 0.7:
            return rng.choice(("", "1"))
        if fd.name == "name" and fd.containing_type.name.endswith("Tensor") and rng.random() < 0.7:
            return "IMAGE"
        return self._string()

    def _string(self) -> str:
        roll = self.rng.random()
        if roll < 0.4:
            return self.rng.choice(PLAUSIBLE_STRINGS)
        if roll < 0.75:
            return self.rng.choice(HOSTILE_STRINGS)
        return "".join(chr(self.rng.choice((self.rng.randint(32, 126), self.rng.randint(0x80, 0xD7FF))))
                       for _ in range(self.rng.randint(0, 24)))

    def _bytes(self) -> bytes:
        size = self.rng.choice((0, 1, 3, 4, 12, 27, 48, 100, 784, 3072, MAX_BYTES))
        return self.rng.choice((bytes(size), b"\xff" * size, self.rng.randbytes(size)))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@dataclass
class Outcome:
    """Status codes per method, with one example call for each code (to reproduce it)."""

    counts: dict[str, Counter] = field(default_factory=dict)
    examples: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, method: str, code: grpc.StatusCode, example: str) -> None:
        self.counts.setdefault(method, Counter())[code.name] += 1
        self.examples.setdefault((method, code.name), example)

    @property
    def num_calls(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())

    def histogram(self) -> Counter:
        total = Counter()
        for counter in self.counts.values():
            total.update(counter)
        return total

    def bad(self, forbidden: Sequence[str]) -> dict[tuple[str, str], str]:
        return {(method, code): self.examples[(method, code)]
                for method, counter in self.counts.items() for code in counter if code in forbidden}

    def table(self) -> str:
        lines = [f"{method}: {dict(sorted(counter.items()))}" for method, counter in sorted(self.counts.items())]
        return "\n".join(lines)


@dataclass(frozen=True)
class FuzzPlan:
    num_calls: int
    seed: int
    concurrency: int = 24
    unary_timeout_s: float = 5.0
    stream_timeout_s: float = 3.0
    max_responses: int = 64
    metadata_choices: tuple[tuple[tuple[str, str], ...], ...] = ((),)
    # Valid requests per method path: a call may start from one (as sent, or mutated) so that what
    # follows it (a worker's results after its hello) or what varies in it reaches deeper code.
    seeds: Mapping[str, Sequence[bytes]] = field(default_factory=dict)


async def fuzz_port(channel: grpc.aio.Channel, blocking: grpc.Channel, methods: Sequence[Method], plan: FuzzPlan
                    ) -> Outcome:
    """`plan.num_calls` hostile calls spread over `methods` (round-robin), `plan.concurrency` at a time.

    Client-streaming calls go through `blocking` (a grpc.Channel to the same port) on threads: when a
    server ends such a call while the grpc.aio client still writes, the aio client replaces the
    server's status with INTERNAL "Internal error from Core" (grpc/grpc#36066); the blocking client
    reports what the server sent.
    """
    outcome = Outcome()
    rng = random.Random(plan.seed)
    # Every call's bytes are drawn up front, in order, so a seed gives the same calls whatever the timing.
    calls = [_draw_call(rng, methods[i % len(methods)], plan) for i in range(plan.num_calls)]
    queue: asyncio.Queue = asyncio.Queue()
    for call in calls:
        queue.put_nowait(call)

    async def worker() -> None:
        while not queue.empty():
            method, kind, messages, metadata = queue.get_nowait()
            if method.client_streaming:
                code = await asyncio.to_thread(_one_streaming_call, blocking, method, messages, metadata, plan)
            else:
                code = await _one_call(channel, method, messages, metadata, plan)
            outcome.add(method.path, code, f"{kind}: {[m[:48].hex() for m in messages]} metadata={metadata}")

    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    return outcome


def _draw_call(rng: random.Random, method: Method, plan: FuzzPlan):
    maker = RequestMaker(rng)
    kind = rng.choice(KINDS)
    num_messages = rng.choice((0, 1, 1, 2, 3, 5)) if method.client_streaming else 1
    messages = [maker.request(method.input_type, kind) for _ in range(num_messages)]
    seeds = plan.seeds.get(method.path)
    if seeds and messages and rng.random() < 0.4:
        seed = rng.choice(seeds)
        kind = "seeded"
        messages[0] = seed if method.client_streaming and rng.random() < 0.7 else maker.mutate(seed)
    return method, kind, messages, rng.choice(plan.metadata_choices)


async def _one_call(channel: grpc.aio.Channel, method: Method, messages: list[bytes], metadata, plan: FuzzPlan
                    ) -> grpc.StatusCode:
    try:
        if not method.server_streaming:
            await channel.unary_unary(method.path)(messages[0], timeout=plan.unary_timeout_s, metadata=metadata)
            return grpc.StatusCode.OK
        call = channel.unary_stream(method.path)(messages[0], timeout=plan.stream_timeout_s, metadata=metadata)
        limit = 1 if method.path in ENDLESS_STREAMS else plan.max_responses
        num_read = 0
        async for _ in call:
            num_read += 1
            if num_read >= limit:
                call.cancel()
                return grpc.StatusCode.OK  # answered; the rest of the stream is not ours to wait for
        return await call.code()
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def _one_streaming_call(channel: grpc.Channel, method: Method, messages: list[bytes], metadata, plan: FuzzPlan
                        ) -> grpc.StatusCode:
    try:
        if not method.server_streaming:
            channel.stream_unary(method.path)(iter(messages), timeout=plan.stream_timeout_s, metadata=metadata)
            return grpc.StatusCode.OK
        call = channel.stream_stream(method.path)(iter(messages), timeout=plan.stream_timeout_s, metadata=metadata)
        for num_read, _ in enumerate(call, start=1):
            if num_read >= plan.max_responses:
                call.cancel()
                return grpc.StatusCode.OK
        return call.code()
    except grpc.RpcError as exc:
        return exc.code()
