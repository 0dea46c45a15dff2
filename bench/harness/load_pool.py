"""The load engine of bench_overload and bench_token_path: processes that replay a LoadPlan over grpc.aio.

Cheap by construction, because it competes with the mesh for the same cores:
request bodies are serialized before the run (bench/harness/load_plan.py), calls go
through bare method handles with no serializer, a unary call is tracked by a
done-callback instead of a task, and replies are parsed only after the run.
A plan too fast for one process is dealt over several (spawned, each with its
own channel and event loop); they start on the same perf_counter instant
(CLOCK_MONOTONIC, shared by every process on the machine), so their shares
add up to the plan's schedule.

Each request carries `x-request-start: t=<unix us>` of its scheduled time.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from dataclasses import dataclass
from functools import partial

import grpc
import uvloop

from bench.harness.load_plan import LoadPlan, RequestTemplate, Rpc, request_start_header, split_plan
from bench.harness.send_result import OK, SendResult, merge_results
from infermesh.v1 import common_pb2, gateway_pb2

CLASSIFY_METHOD = "/infermesh.v1.Inference/Classify"
GENERATE_METHOD = "/infermesh.v1.Inference/Generate"
AGGREGATE_STAGES = frozenset({common_pb2.STAGE_GATEWAY, common_pb2.STAGE_SCHEDULER})
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_retries", 0)]
# After the last send, how long replies may take beyond the longest deadline before the run gives up.
DRAIN_GRACE_S = 5.0
# The parent picks the common start this long after every process said it is ready.
START_LEAD_S = 0.3


@dataclass(frozen=True)
class ClosedLoopJob:
    """`concurrency` clients each sending the next template as soon as their last stream ended."""

    templates: tuple[RequestTemplate, ...]
    concurrency: int
    duration_s: float


class LoadPool:
    """Spawned load processes, kept for the whole benchmark (spawn: no grpc state crosses a fork)."""

    def __init__(self, num_procs: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        # CPU the load processes spent sending and receiving in the last replay (not preparing or parsing).
        self.last_send_cpu_s = 0.0
        for _ in range(num_procs):
            parent, child = context.Pipe()
            proc = context.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def pids(self) -> dict[str, int]:
        return {f"load-{i}": proc.pid for i, proc in enumerate(self._procs)}

    @property
    def max_procs(self) -> int:
        return len(self._procs)

    def replay(self, target: str, plan: LoadPlan, num_procs: int) -> list[SendResult]:
        """Replays `plan` from `num_procs` processes; every request's result, in scheduled order."""
        if not 1 <= num_procs <= len(self._conns):
            raise ValueError(f"num_procs must be in [1, {len(self._conns)}], got {num_procs}")
        conns = self._conns[:num_procs]
        for conn, part in zip(conns, split_plan(plan, num_procs), strict=True):
            conn.send(("replay", target, part))
        for conn in conns:
            _expect(conn.recv(), "ready")
        origin_s = time.perf_counter() + START_LEAD_S
        origin_unix_s = time.time() + START_LEAD_S
        for conn in conns:
            conn.send((origin_s, origin_unix_s))
        replies = [_expect_results(conn.recv()) for conn in conns]
        self.last_send_cpu_s = sum(cpu_s for _, cpu_s in replies)
        return merge_results(results for results, _ in replies)

    def closed_loop(self, target: str, job: ClosedLoopJob) -> tuple[list[SendResult], float]:
        """Runs a closed-loop job in the first process: its results and its measured length."""
        self._conns[0].send(("closed", target, job))
        results, elapsed_s = _expect_results(self._conns[0].recv())
        return results, elapsed_s

    def close(self) -> None:
        for conn in self._conns:
            conn.send(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> LoadPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _expect(message, expected: str):
    if isinstance(message, BaseException):
        raise RuntimeError("load process failed") from message
    if message != expected:
        raise RuntimeError(f"load process said {message!r}, expected {expected!r}")
    return message


def _expect_results(message):
    if isinstance(message, BaseException):
        raise RuntimeError("load process failed") from message
    return message


# -- inside a load process ------------------------------------------------------------


def _serve(conn) -> None:
    while (job := conn.recv()) is not None:
        try:
            kind, target, payload = job
            if kind == "replay":
                conn.send(uvloop.run(_replay(conn, target, payload)))
            else:
                conn.send(uvloop.run(_closed_loop(target, payload)))
        except Exception as exc:  # the parent re-raises it with context
            conn.send(exc)


async def _replay(conn, target: str, plan: LoadPlan) -> tuple[list[SendResult], float]:
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=10)
        classify = channel.unary_unary(CLASSIFY_METHOD)
        generate = channel.unary_stream(GENERATE_METHOD)
        auth = {i: ("authorization", f"Bearer {t.api_key}") for i, t in enumerate(plan.templates)}
        conn.send("ready")
        origin_s, origin_unix_s = conn.recv()
        cpu_before_s = time.process_time()
        metadata = [(auth[s.template], request_start_header(origin_unix_s, s.scheduled_s)) for s in plan.sends]
        tracker = _Tracker(len(plan.sends))
        streams = []
        for i, send in enumerate(plan.sends):
            template = plan.templates[send.template]
            due_s = origin_s + send.scheduled_s
            await _sleep_until(due_s)
            sent_s = time.perf_counter()
            tracker.sent_s[i] = sent_s
            timeout_s = due_s + template.deadline_s - sent_s
            if timeout_s <= 0:  # its deadline passed while the generator was late: never sent
                tracker.missed(i)
                continue
            if template.rpc is Rpc.CLASSIFY:
                call = classify(template.body, timeout=timeout_s, metadata=metadata[i])
                tracker.calls[i] = call
                call.add_done_callback(partial(tracker.done, i))
            else:
                streams.append(asyncio.ensure_future(tracker.stream(i, generate(
                    template.body, timeout=timeout_s, metadata=metadata[i]))))
        longest_deadline_s = max((t.deadline_s for t in plan.templates), default=0.0)
        try:
            await asyncio.wait_for(tracker.all_done, timeout=longest_deadline_s + DRAIN_GRACE_S)
        except TimeoutError:
            pass  # whatever is still open is reported as CANCELLED below
        for call in tracker.calls:
            if call is not None and not call.done():
                call.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        send_cpu_s = time.process_time() - cpu_before_s
        return [await _result(plan, i, origin_s, tracker) for i in range(len(plan.sends))], send_cpu_s


class _Tracker:
    """Send and reply times of every request of one replay, indexed like the plan's sends."""

    def __init__(self, num_sends: int) -> None:
        self.sent_s = [0.0] * num_sends
        self.done_s = [0.0] * num_sends
        self.calls: list = [None] * num_sends
        self.chunks: list = [None] * num_sends  # streams: [(receipt time, raw chunk)], then the status
        self.stream_status: list[str | None] = [None] * num_sends
        self.stream_message = [""] * num_sends
        self._num_left = num_sends
        self.all_done = asyncio.get_running_loop().create_future()
        if num_sends == 0:
            self.all_done.set_result(None)

    def done(self, i: int, _call=None) -> None:
        self.done_s[i] = time.perf_counter()
        self._num_left -= 1
        if self._num_left == 0 and not self.all_done.done():
            self.all_done.set_result(None)

    def missed(self, i: int) -> None:
        self.stream_status[i] = "DEADLINE_EXCEEDED"
        self.stream_message[i] = "deadline passed before the load generator sent it"
        self.done(i)

    async def stream(self, i: int, call) -> None:
        chunks = []
        try:
            async for chunk in call:
                chunks.append((time.perf_counter(), chunk))
            self.stream_status[i] = OK
        except grpc.aio.AioRpcError as err:
            self.stream_status[i] = err.code().name
            self.stream_message[i] = err.details() or ""
        except asyncio.CancelledError:
            self.stream_status[i] = "CANCELLED"
        self.chunks[i] = chunks
        self.done(i)


async def _result(plan: LoadPlan, i: int, origin_s: float, tracker: _Tracker) -> SendResult:
    send = plan.sends[i]
    template = plan.templates[send.template]
    sent_s, done_s = tracker.sent_s[i] - origin_s, tracker.done_s[i] - origin_s
    if tracker.calls[i] is not None:
        try:
            reply = gateway_pb2.ClassifyResponse.FromString(await tracker.calls[i])
        except grpc.aio.AioRpcError as err:
            return SendResult(template.tenant, send.scheduled_s, sent_s, done_s, err.code().name,
                              message=err.details() or "")
        except asyncio.CancelledError:
            return SendResult(template.tenant, send.scheduled_s, sent_s, done_s, "CANCELLED")
        return SendResult(template.tenant, send.scheduled_s, sent_s, done_s, OK, _leaf_stage_us(reply.timings))
    status = tracker.stream_status[i] or "CANCELLED"
    if status != OK or not tracker.chunks[i]:
        return SendResult(template.tenant, send.scheduled_s, sent_s, done_s, status,
                          message=tracker.stream_message[i])
    return _stream_result(template, send.scheduled_s, sent_s, done_s, tracker.chunks[i], origin_s)


def _stream_result(template: RequestTemplate, scheduled_s: float, sent_s: float, done_s: float,
                   chunks: list, origin_s: float) -> SendResult:
    first_token_s = None
    num_tokens = 0
    last = None
    for receipt_s, raw in chunks:
        chunk = gateway_pb2.GenerateResponse.FromString(raw)
        if chunk.token_ids:
            num_tokens += len(chunk.token_ids)
            if first_token_s is None:
                first_token_s = receipt_s - origin_s
        if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            last = chunk
    if last is None:
        return SendResult(template.tenant, scheduled_s, sent_s, done_s, "STREAM_TRUNCATED", num_tokens=num_tokens)
    ttft_s = first_token_s - scheduled_s if first_token_s is not None else None
    predicted_ttft_s = last.predicted_ttft_us / 1e6 if last.predicted_ttft_us > 0 else None
    return SendResult(template.tenant, scheduled_s, sent_s, done_s, OK, _leaf_stage_us(last.timings), ttft_s,
                      num_tokens, predicted_ttft_s=predicted_ttft_s)


def _leaf_stage_us(timings: common_pb2.Timings) -> int:
    return sum(s.duration_us for s in timings.stages if s.stage not in AGGREGATE_STAGES)


async def _sleep_until(due_s: float) -> None:
    """Sleeps until perf_counter reaches due_s, yielding at least once so replies are processed
    (grpc.aio starts a call in a task: without a yield a late generator would only queue them)."""
    remaining_s = due_s - time.perf_counter()
    if remaining_s <= 0:
        await asyncio.sleep(0)
        return
    while remaining_s > 0:  # uvloop's timers tick in milliseconds and may fire early
        await asyncio.sleep(remaining_s)
        remaining_s = due_s - time.perf_counter()


async def _closed_loop(target: str, job: ClosedLoopJob) -> tuple[list[SendResult], float]:
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        await asyncio.wait_for(channel.channel_ready(), timeout=10)
        generate = channel.unary_stream(GENERATE_METHOD)
        origin_s = time.perf_counter()
        end_s = origin_s + job.duration_s
        results: list[SendResult] = []
        next_template = iter(range(1 << 62))

        async def client() -> None:
            while time.perf_counter() < end_s:
                template = job.templates[next(next_template) % len(job.templates)]
                sent_s = time.perf_counter()
                chunks = []
                status, message = OK, ""
                try:
                    async for chunk in generate(template.body, timeout=template.deadline_s,
                                                metadata=(("authorization", f"Bearer {template.api_key}"),)):
                        chunks.append((time.perf_counter(), chunk))
                except grpc.aio.AioRpcError as err:
                    status, message = err.code().name, err.details() or ""
                done_s = time.perf_counter()
                if done_s > end_s:
                    return  # only streams that ended inside the window count
                scheduled_s = sent_s - origin_s
                if status != OK or not chunks:
                    results.append(SendResult(template.tenant, scheduled_s, scheduled_s, done_s - origin_s, status,
                                              message=message))
                else:
                    results.append(_stream_result(template, scheduled_s, scheduled_s, done_s - origin_s, chunks,
                                                  origin_s))

        await asyncio.gather(*(client() for _ in range(job.concurrency)))
        return results, time.perf_counter() - origin_s
