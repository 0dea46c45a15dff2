"""Steady mixed load on the gateways for reliability tests, counted call by call.

Open loop: classify calls and Generate streams are started at fixed rates whatever happens
to earlier ones (a fault must not slow the offered load down and hide itself). Every call
is judged when it ends:

* classify: the right label, within its deadline;
* a stream: no error, every chunk's `index` equal to the tokens read before it (nothing
  repeated, nothing missing), the text equal to the unbroken reference, exactly one final
  chunk, usage counting every token.

Greedy streams and seeded sampled streams both run: the mock generator's tokens are a
function of (seed, position, last token), so the reference is known without a model.

Calls go through grpc.aio on one event loop in a background thread (cheaper on a shared
2-core box than a thread per call). A gRPC client that reaches several gateways spreads
its calls with round_robin and retries UNAVAILABLE (what a connect to a dead gateway
ends with) through the channel's service config; see `channel_options`. A call refused
RESOURCE_EXHAUSTED (shed, the adaptive limit, a quota) is sent again after the server's
`grpc-retry-pushback-ms` while its deadline allows, as docs/operations.md tells a client ("Overload refusals"):
such a refusal is overload control working, not a lost call; `num_overload_retries` counts them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.status import pushback_ms_of
from tools.testbed import session_tls
from tools.testbed.generator_models import mock_text

CLASSIFIER = common_pb2.ModelRef(name="toy-classifier")
GENERATOR = common_pb2.ModelRef(name="mock-generator")
BRIGHT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))
BRIGHT_LABEL = "bright"


def channel_options(num_attempts: int = 5, health_check: bool = False) -> list[tuple[str, object]]:
    """A channel that spreads calls over every address of its target and retries UNAVAILABLE.

    A call whose connection dies before any response arrived (a gateway killed under it, or a
    connect refused) fails UNAVAILABLE and is not yet committed, so gRPC retries it on another
    subchannel; a stream that already delivered tokens is committed and is the caller's to redo.
    `health_check`: client-side health checking (grpc.health.v1 Watch per gateway), so a gateway
    that turns NOT_SERVING as its drain starts gets no new calls (docs/operations.md, "Gateways").
    """
    if num_attempts <= 1:  # no retries of gRPC's own: every failure the gateway returns is counted
        return [("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
                ("grpc.enable_retries", 0)]
    service_config: dict[str, object] = {
        "loadBalancingConfig": [{"round_robin": {}}],
        **({"healthCheckConfig": {"serviceName": "infermesh.v1.Inference"}} if health_check else {}),
        "methodConfig": [{
            "name": [{"service": "infermesh.v1.Inference"}],
            "retryPolicy": {
                "maxAttempts": num_attempts,
                "initialBackoff": "0.05s",
                "maxBackoff": "0.5s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }],
    }
    return [("grpc.service_config", json.dumps(service_config)), ("grpc.enable_retries", 1)]


@dataclass(frozen=True)
class StreamSpec:
    """One kind of stream the load sends: a prompt, a length and greedy or seeded sampling."""

    prompt: str
    max_tokens: int
    seed: int | None = None  # None: greedy; otherwise temperature 1 with this seed

    def request(self, request_id: str) -> gateway_pb2.GenerateRequest:
        sampling = common_pb2.SamplingParams(max_tokens=self.max_tokens)
        if self.seed is not None:
            sampling.temperature = 1.0
            sampling.seed = self.seed
        return gateway_pb2.GenerateRequest(model=GENERATOR, prompt=self.prompt, sampling=sampling,
                                           request_id=request_id)

    def reference(self) -> str:
        """The text of an unbroken stream (the mock uses seed 0 for greedy requests)."""
        return mock_text(self.prompt, self.max_tokens, self.seed or 0)


DEFAULT_STREAMS = (
    StreamSpec("abc", 80), StreamSpec("hello", 80),
    StreamSpec("abc", 80, seed=7), StreamSpec("mesh", 80, seed=12345),
)


@dataclass(frozen=True)
class LoadShape:
    classify_per_s: float = 60.0
    streams_per_s: float = 4.0
    classify_deadline_s: float = 10.0
    stream_deadline_s: float = 30.0
    streams: tuple[StreamSpec, ...] = DEFAULT_STREAMS
    # A stream cut after tokens arrived is re-sent and its delivered prefix checked and skipped:
    # what a client of several gateways must do when the gateway holding its stream dies.
    client_resumes_streams: bool = False
    # gRPC's own retries of UNAVAILABLE before any response (a gateway killed under the call); off:
    # the gateway alone must keep every call.
    client_retries: bool = True
    # Client-side health checking (channel_options): new calls leave a gateway once it is NOT_SERVING.
    client_health_check: bool = False
    # RESOURCE_EXHAUSTED with a pushback is sent again after it (before any token) while the call's deadline
    # allows, at most this many times (None: no count, only the deadline); 0: every refusal is a failure.
    # A count of 5 was not enough: the adaptive limit's hint is the wait for one slot (0.07 s), and a
    # starved box stayed at its limit for longer than five of them.
    overload_retries: int | None = None


@dataclass
class LoadCounts:
    num_classify: int = 0
    num_greedy_streams: int = 0
    num_sampled_streams: int = 0
    num_client_resumed_streams: int = 0
    num_overload_retries: int = 0  # RESOURCE_EXHAUSTED refusals sent again after their pushback
    failed_classify: list[str] = field(default_factory=list)
    failed_streams: list[str] = field(default_factory=list)
    wrong_text: list[str] = field(default_factory=list)
    bad_indices: list[str] = field(default_factory=list)
    failure_codes: Counter = field(default_factory=Counter)  # status code name -> failed calls

    def problems(self) -> dict[str, int]:
        """The counts the issue requires to be 0."""
        return {"failed_classify": len(self.failed_classify), "failed_streams": len(self.failed_streams),
                "wrong_text": len(self.wrong_text), "bad_indices": len(self.bad_indices)}

    def summary(self) -> str:
        return (f"classify {self.num_classify}, streams {self.num_greedy_streams} greedy + "
                f"{self.num_sampled_streams} sampled (client-resumed {self.num_client_resumed_streams}, "
                f"sent again after an overload refusal {self.num_overload_retries}); "
                f"problems {self.problems()}" + (f", by code {dict(self.failure_codes)}" if self.failure_codes else ""))

    def examples(self, num: int = 3) -> str:
        lists = (self.failed_classify, self.failed_streams, self.wrong_text, self.bad_indices)
        return "\n".join(example for examples in lists for example in examples[:num])

    def assert_nothing_lost(self, phase: str, logs: Callable[[], str], min_classify: int = 100) -> None:
        """Prints the phase's counts, then requires every problem count to be 0 and some of each call."""
        print(f"{phase}: {self.summary()}")
        # The lost calls again after the logs: CI keeps a failure's head and tail, and once cut them out.
        assert self.problems() == dict.fromkeys(self.problems(), 0), (
            f"{phase}: {self.examples()}\n{logs()}\n--- lost, again: {self.examples()}")
        assert self.num_classify >= min_classify and self.num_greedy_streams >= 4 and self.num_sampled_streams >= 4, (
            f"{phase}: too little load to judge: {self.summary()}")


@dataclass
class _StreamRead:
    spec: StreamSpec
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    num_final_chunks: int = 0
    completion_tokens: int = -1
    problems: list[str] = field(default_factory=list)

    def take(self, chunk: gateway_pb2.GenerateResponse, skip_before: int) -> None:
        """One chunk; with skip_before > 0 (a re-sent stream) tokens below it must equal what was read."""
        if chunk.token_ids:
            if chunk.index + len(chunk.token_ids) <= skip_before:
                if list(chunk.token_ids) != self.token_ids[chunk.index:chunk.index + len(chunk.token_ids)]:
                    self.problems.append(f"re-sent tokens at {chunk.index} differ from those delivered")
            elif chunk.index != len(self.token_ids):
                self.problems.append(f"chunk index {chunk.index} after {len(self.token_ids)} tokens")
            else:
                self.token_ids.extend(chunk.token_ids)
                self.text.append(chunk.text)
        if chunk.finish_reason:
            self.num_final_chunks += 1
            self.completion_tokens = chunk.usage.completion_tokens


def _pushback_s(exc: grpc.RpcError) -> float | None:
    """The server's `grpc-retry-pushback-ms` in seconds; None when absent or negative (do not retry)."""
    pushback_ms = pushback_ms_of(exc)
    return pushback_ms / 1000 if pushback_ms is not None and pushback_ms >= 0 else None


def _wall_clock() -> str:
    """Time of day to the millisecond, as the services' log lines print it (to match a failure to them: the
    gateway roll's lost calls were sent at a restarted gateway's start, and failed at the other one's stop)."""
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f",{int(now * 1000) % 1000:03d}"


class MeshLoad:
    """Runs the load until stop(); counts() afterwards. `target` is a gRPC target string."""

    def __init__(self, target: str, shape: LoadShape | None = None) -> None:
        self.target = target
        self.shape = shape or LoadShape()
        self._counts = LoadCounts()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mesh-load", daemon=True)
        self._stopping = asyncio.Event()
        self._main: asyncio.Future | None = None
        self._stopped = False
        self._num_done = 0
        self._done_lock = threading.Lock()

    def start(self) -> MeshLoad:
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._run(), self._loop)
        return self

    @property
    def num_done(self) -> int:
        """Calls finished so far (any outcome)."""
        with self._done_lock:
            return self._num_done

    def wait_completed(self, num: int, during: str, timeout_s: float = 30.0) -> None:
        """Until `num` more calls have ended (any outcome): the load goes on through `during`."""
        target = self.num_done + num
        give_up = time.monotonic() + timeout_s
        while self.num_done < target:
            if time.monotonic() > give_up:
                raise TimeoutError(f"{num} calls not completed {during} within {timeout_s}s")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 60.0) -> LoadCounts:
        """Stops sending, waits for every call already sent to end, and returns the counts (again if stopped)."""
        if not self._stopped:
            self._stopped = True
            self._loop.call_soon_threadsafe(self._stopping.set)
            try:
                self._main.result(timeout=timeout_s)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=5)
        return self._counts

    async def _run(self) -> None:
        # A channel each: on one round_robin channel the two fixed rates interleave in a fixed
        # pattern that can put every stream on the same gateway.
        options = channel_options(5 if self.shape.client_retries else 1, self.shape.client_health_check)
        async with (session_tls.aio_channel(self.target, options=options) as classify_channel,
                    session_tls.aio_channel(self.target, options=options) as stream_channel):
            classify_stub = gateway_pb2_grpc.InferenceStub(classify_channel)
            stream_stub = gateway_pb2_grpc.InferenceStub(stream_channel)
            await asyncio.gather(
                self._open_loop(self.shape.classify_per_s, lambda n: self._classify(classify_stub, n)),
                self._open_loop(self.shape.streams_per_s, lambda n: self._stream(stream_stub, n)),
            )

    async def _open_loop(self, rate_per_s: float, make_call) -> None:
        if rate_per_s <= 0:
            return
        calls: set[asyncio.Task] = set()
        next_at = self._loop.time()
        for number in itertools.count():
            calls.add(asyncio.ensure_future(make_call(number)))
            next_at += 1 / rate_per_s
            try:
                await asyncio.wait_for(self._stopping.wait(), timeout=max(0.0, next_at - self._loop.time()))
                break
            except TimeoutError:
                pass
        await asyncio.gather(*calls)

    def _finished(self) -> None:
        with self._done_lock:
            self._num_done += 1

    async def _classify(self, stub, number: int) -> None:
        self._counts.num_classify += 1
        request = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT, request_id=f"c{number}")
        name = f"classify c{number} sent {_wall_clock()}"
        deadline = self._loop.time() + self.shape.classify_deadline_s
        try:
            for attempt in itertools.count():
                try:
                    reply = await stub.Classify(request, timeout=max(0.1, deadline - self._loop.time()))
                    break
                except grpc.RpcError as exc:
                    if not await self._after_pushback(exc, attempt, deadline):
                        raise
            if reply.labels[0].label != BRIGHT_LABEL:
                self._counts.failed_classify.append(f"{name}: label {reply.labels[0].label!r}")
        except grpc.RpcError as exc:
            self._counts.failed_classify.append(f"{name}, failed {_wall_clock()}: {exc.code().name} {exc.details()}")
            self._counts.failure_codes[f"classify {exc.code().name}"] += 1
        finally:
            self._finished()

    async def _stream(self, stub, number: int) -> None:
        spec = self.shape.streams[number % len(self.shape.streams)]
        if spec.seed is None:
            self._counts.num_greedy_streams += 1
        else:
            self._counts.num_sampled_streams += 1
        name = f"stream s{number} ({spec.prompt!r}, seed {spec.seed}) sent {_wall_clock()}"
        read = _StreamRead(spec)
        try:
            await self._read_stream(stub, spec, f"s{number}", read)
        except grpc.RpcError as exc:
            self._counts.failed_streams.append(f"{name}, failed {_wall_clock()}: {exc.code().name} {exc.details()} "
                                               f"after {len(read.token_ids)} tokens")
            self._counts.failure_codes[f"stream {exc.code().name}"] += 1
            return
        finally:
            self._finished()
        self._judge(name, read)

    async def _read_stream(self, stub, spec: StreamSpec, request_id: str, read: _StreamRead) -> None:
        loop_deadline = self._loop.time() + self.shape.stream_deadline_s
        num_refusals = 0
        while True:
            delivered = len(read.token_ids)
            call = stub.Generate(spec.request(request_id), timeout=max(0.1, loop_deadline - self._loop.time()))
            try:
                async for chunk in call:
                    read.take(chunk, skip_before=delivered)
                return
            except grpc.RpcError as exc:
                if not read.token_ids and await self._after_pushback(exc, num_refusals, loop_deadline):
                    num_refusals += 1
                    continue
                resumable = (self.shape.client_resumes_streams and exc.code() == grpc.StatusCode.UNAVAILABLE
                             and self._loop.time() < loop_deadline)
                if not resumable:
                    raise
                self._counts.num_client_resumed_streams += 1

    async def _after_pushback(self, exc: grpc.RpcError, num_before: int, deadline: float) -> bool:
        """True once the server's pushback has passed, when `exc` is an overload refusal to send again."""
        pushback_s = _pushback_s(exc) if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else None
        limit = self.shape.overload_retries
        if pushback_s is None or (limit is not None and num_before >= limit):
            return False
        if self._loop.time() + pushback_s >= deadline:
            return False
        self._counts.num_overload_retries += 1
        await asyncio.sleep(pushback_s)
        return True

    def _judge(self, name: str, read: _StreamRead) -> None:
        spec = read.spec
        if read.problems or read.num_final_chunks != 1:
            self._counts.bad_indices.append(f"{name}: {read.problems[:3]}, {read.num_final_chunks} final chunks")
        if len(read.token_ids) != spec.max_tokens or read.completion_tokens != spec.max_tokens:
            self._counts.bad_indices.append(f"{name}: {len(read.token_ids)} tokens read, usage says "
                                            f"{read.completion_tokens}, expected {spec.max_tokens}")
        text = "".join(read.text)
        if text != spec.reference():
            self._counts.wrong_text.append(f"{name}: {text!r} != {spec.reference()!r}")
