"""GeneratePool wired to in-process fake workers over WorkerLink (no gRPC): failover, held
sequences, a worker re-dialling under the same id, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common import errors
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool, GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.worker_link import ModelKey, WorkerLink

MODEL = ModelKey("toy-generator", "1")


def hello(worker_id: str) -> scheduler_pb2.WorkerHello:
    return scheduler_pb2.WorkerHello(
        worker_id=worker_id,
        model=common_pb2.ModelRef(name=MODEL.name, version=MODEL.version),
        kind=common_pb2.MODEL_KIND_GENERATOR,
        capacity=scheduler_pb2.WorkerCapacity(num_kv_blocks=64, block_size=4, max_seq_len=128, max_num_seqs=8,
                                              max_num_batched_tokens=64),
        tokenizer=scheduler_pb2.TokenizerSpec(kind=scheduler_pb2.TOKENIZER_KIND_BYTES, vocab_size=257,
                                              eos_token_id=256, bos_token_id=-1),
    )


class FakeWorker:
    """Answers RunStep commands like the toy generator: the next letter after the last token."""

    def __init__(self, link: WorkerLink, step_s: float = 0.001) -> None:
        self.link = link
        self.num_steps = 0
        self.forgotten: set[int] = set()  # sequences the scheduler told it to drop
        self._step_s = step_s
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while (command := await self.link.next_command()) is not None:
            if command.WhichOneof("kind") == "abort":
                self.forgotten.update(command.abort.seq_ids)
            if command.WhichOneof("kind") != "run_step":
                continue
            self.forgotten.update(command.run_step.finished_seq_ids)
            await asyncio.sleep(self._step_s)
            self.num_steps += 1
            step = command.run_step
            outputs = [scheduler_pb2.SequenceOutput(seq_id=s.seq_id, token_id=_next_letter(s.token_ids[-1]))
                       for s in step.seqs if s.sample]
            self.link.on_result(step.step_id, scheduler_pb2.StepResult(step_id=step.step_id, outputs=outputs))


def _next_letter(token_id: int) -> int:
    return ord("a") + (token_id - ord("a") + 1) % 26


def expected(prompt: str, num_tokens: int) -> str:
    out, last = [], ord(prompt[-1])
    for _ in range(num_tokens):
        last = _next_letter(last)
        out.append(chr(last))
    return "".join(out)


def attach(pool: GeneratePool, worker_id: str, step_s: float = 0.001) -> FakeWorker:
    link = WorkerLink(hello(worker_id))
    pool.add_worker(link)
    return FakeWorker(link, step_s)


def detach(pool: GeneratePool, worker: FakeWorker) -> None:
    worker.link.close()  # the stream broke: in-flight steps fail with WorkerGone
    pool.remove_worker(worker.link)


def submit(pool: GeneratePool, prompt: str, max_tokens: int, deadline_s: float | None = None) -> Reader:
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"),
                            sampling_proto=common_pb2.SamplingParams(max_tokens=max_tokens), trace_context={},
                            arrival_s=pool.clock(), deadline_s=deadline_s)
    pool.submit(stream, tuple(prompt.encode()), SamplingParams(max_tokens=max_tokens))
    return Reader(stream)


class Reader:
    """Reads one stream as a client would, checking each chunk starts where the last one ended."""

    def __init__(self, stream: GenerateStream) -> None:
        self.stream = stream
        self.num_tokens = 0

    async def read(self, *, until_tokens: int | None = None) -> str:
        """Text up to the end of the stream, or until `until_tokens` tokens in all were read."""
        text = []
        while until_tokens is None or self.num_tokens < until_tokens:
            event = await asyncio.wait_for(self.stream.events.get(), timeout=5)
            if event.error is not None:
                raise event.error
            delta = event.delta
            assert delta.index == self.num_tokens, "no token skipped or repeated"
            self.num_tokens += len(delta.token_ids)
            text.append(delta.text)
            if delta.is_last:
                break
        return "".join(text)


@pytest.fixture
def pool() -> GeneratePool:
    return GeneratePool(MODEL, hello("w0"), SchedulerConfig())


async def test_stream_continues_exactly_on_another_worker_when_its_worker_breaks(pool):
    first = attach(pool, "w1", step_s=0.005)
    reader = submit(pool, "abc", 40)
    head = await reader.read(until_tokens=10)
    second = attach(pool, "w2")
    detach(pool, first)
    tail = await reader.read()
    assert head + tail == expected("abc", 40)
    assert second.num_steps > 0 and pool.pressure().kv_usage == 0


async def test_without_workers_evicted_sequences_are_held_until_one_attaches(pool):
    only = attach(pool, "w1", step_s=0.005)
    reader = submit(pool, "xyz", 30)
    head = await reader.read(until_tokens=5)
    detach(pool, only)
    assert pool.queue_depth == 1 and pool.pressure().num_workers == 0
    with pytest.raises(errors.Unavailable, match="no worker serves model toy-generator:1"):
        submit(pool, "new", 3)
    await asyncio.sleep(0.02)
    assert reader.stream.events.empty(), "nothing streams while held"
    attach(pool, "w2")
    tail = await reader.read()
    assert head + tail == expected("xyz", 30)


async def test_held_sequences_fail_at_their_deadline(pool):
    only = attach(pool, "w1", step_s=0.005)
    reader = submit(pool, "abc", 30, deadline_s=pool.clock() + 0.1)
    await reader.read(until_tokens=2)
    detach(pool, only)
    with pytest.raises(errors.DeadlineExceeded, match="deadline passed after"):
        await reader.read()


async def test_a_worker_redialling_under_the_same_id_keeps_its_new_stream(pool):
    old = attach(pool, "w1")
    new = attach(pool, "w1")  # re-dialled before the old stream's break was noticed
    detach(pool, old)
    assert pool.workers == [new.link]
    assert await submit(pool, "abc", 5).read() == "defgh" and new.num_steps > 0


async def test_cancelling_frees_the_blocks_and_tells_the_worker(pool):
    worker = attach(pool, "w1", step_s=0.002)
    reader = submit(pool, "abc", 100)
    await reader.read(until_tokens=3)
    assert pool.pressure().kv_usage > 0
    pool.abort(reader.stream)
    assert pool.pressure().kv_usage == 0, "freed at once, not at the next step"
    assert reader.stream.finished
    await asyncio.sleep(0.02)
    assert reader.stream.seq_id in worker.forgotten
    assert pool.pressure().kv_usage == 0 and worker.num_steps < 100


async def _until(condition, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), timeout_s)


async def test_handing_a_stream_over_ends_it_with_the_error_frees_its_blocks_and_tells_the_worker(pool):
    worker = attach(pool, "w1", step_s=0.002)
    reader = submit(pool, "abc", 100)
    other = submit(pool, "xyz", 20)
    await reader.read(until_tokens=3)
    handover = errors.Unavailable("scheduler draining: stream handed over", retry_after_s=0.0)
    assert pool.hand_over(reader.stream, handover)
    assert not pool.hand_over(reader.stream, handover), "a stream is handed over once"
    with pytest.raises(errors.Unavailable, match="^scheduler draining: stream handed over$"):
        await reader.read()
    await _until(lambda: reader.stream.seq_id in worker.forgotten)
    assert await other.read() == expected("xyz", 20), "the other stream runs on untouched"
    assert pool.pressure().kv_usage == 0


async def test_a_continuation_streams_the_rest_from_its_index(pool):
    attach(pool, "w1")
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"),
                            sampling_proto=common_pb2.SamplingParams(max_tokens=12), trace_context={},
                            arrival_s=pool.clock(), deadline_s=None)
    whole = expected("abc", 12)
    pool.submit(stream, tuple(b"abc"), SamplingParams(max_tokens=12), tuple(whole[:5].encode()))
    reader = Reader(stream)
    reader.num_tokens = 5  # the client holds tokens 0..4
    assert await reader.read() == whole[5:]
    assert reader.num_tokens == 12


async def test_a_continuations_first_token_is_no_time_to_first_token(pool):
    # A stream resumed here already gave its client a first token elsewhere.
    def num_ttft() -> float:
        return REGISTRY.get_sample_value(
            "infermesh_scheduler_time_to_first_token_seconds_count",
            {"model": MODEL.name, "version": MODEL.version}) or 0.0

    attach(pool, "w1")
    before = num_ttft()
    resumed = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"),
                             sampling_proto=common_pb2.SamplingParams(max_tokens=6), trace_context={},
                             arrival_s=pool.clock(), deadline_s=None)
    delivered = tuple(expected("abc", 2).encode())
    pool.submit(resumed, tuple(b"abc"), SamplingParams(max_tokens=6), delivered_token_ids=delivered)
    reader = Reader(resumed)
    reader.num_tokens = len(delivered)  # indices continue after the delivered tokens
    await reader.read()
    assert num_ttft() == before
    await submit(pool, "abc", 4).read()
    assert num_ttft() == before + 1
