"""GeneratePool wired to in-process fake workers over WorkerLink (no gRPC): failover, held
sequences, a worker re-dialling under the same id, cancellation. Time is a fake clock: a fake
worker's step advances it, a test advances it to pass a deadline; nothing waits on wall time."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from services.common import errors
from services.scheduler.attach_types import (
    AbortCommand,
    ModelKind,
    StepCommand,
    StepOutcome,
    WorkerCapacity,
    WorkerHello,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.tokenizer_spec import TokenizerSpec
from services.scheduler.worker_link import ModelKey, WorkerLink
from tests.unit.scheduler.conftest import until_turns
from tools.testbed.fake_clock import FakeClock

MODEL = ModelKey("toy-generator", "1")


def hello(worker_id: str) -> WorkerHello:
    return WorkerHello(
        worker_id=worker_id,
        model=MODEL,
        kind=ModelKind.GENERATOR,
        capacity=WorkerCapacity(num_kv_blocks=64, block_size=4, max_seq_len=128, max_num_seqs=8,
                                max_num_batched_tokens=64),
        protocol_version=1,
        tokenizer=TokenizerSpec(vocab_size=257, eos_token_id=256, bos_token_id=-1),
    )


class FakeWorker:
    """Answers steps like the toy generator (the next letter after the last token); each step
    takes `step_s` of the fake clock."""

    def __init__(self, link: WorkerLink, clock: FakeClock, step_s: float = 0.001) -> None:
        self.link = link
        self.num_steps = 0
        self.forgotten: set[int] = set()  # sequences the scheduler told it to drop
        self._clock = clock
        self._step_s = step_s
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while (command := await self.link.next_command()) is not None:
            if isinstance(command, AbortCommand):
                self.forgotten.update(command.seq_ids)
            if not isinstance(command, StepCommand):
                continue
            plan = command.plan
            self.forgotten.update(plan.finished_seq_ids)
            self._clock.advance(self._step_s)
            self.num_steps += 1
            tokens = {s.seq_id: _next_letter(s.token_ids[-1]) for s in plan.seqs if s.sample}
            self.link.on_result(plan.step_id, StepOutcome(tokens, {}, self._step_s))


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
    return FakeWorker(link, pool.clock, step_s)  # the pool runs on the test's FakeClock


def detach(pool: GeneratePool, worker: FakeWorker) -> None:
    worker.link.close()  # the stream broke: in-flight steps fail with WorkerGone
    pool.remove_worker(worker.link)


def submit(pool: GeneratePool, prompt: str, max_tokens: int, deadline_s: float | None = None) -> Reader:
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"), seed=0, trace_context={},
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
            event = await asyncio.wait_for(self.stream.events.get(), timeout=5)  # a hang fails, not blocks
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
    clock = FakeClock(autojump_turns=200)  # the first step after an idle spell waits a little (StepPacing.gather)
    return GeneratePool(MODEL, hello("w0"), SchedulerConfig(), clock=clock, sleep=clock.sleep)


async def _settle(turns: int = 50) -> None:
    """Gives every task a chance to run: what could happen without time passing has happened."""
    for _ in range(turns):
        await asyncio.sleep(0)


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
    await _settle()  # the step the worker finished before its stream broke is still delivered
    num_queued = reader.stream.events.qsize()
    assert pool.queue_depth == 1 and pool.pressure().num_workers == 0
    with pytest.raises(errors.Unavailable, match="no worker serves model toy-generator:1"):
        submit(pool, "new", 3)
    await _settle()
    assert reader.stream.events.qsize() == num_queued, "nothing streams while held"
    attach(pool, "w2")
    tail = await reader.read()
    assert head + tail == expected("xyz", 30)


async def test_held_sequences_fail_at_their_deadline(pool):
    only = attach(pool, "w1", step_s=0.005)
    reader = submit(pool, "abc", 30, deadline_s=pool.clock() + 0.1)
    await reader.read(until_tokens=2)
    detach(pool, only)
    await _settle()
    num_queued = reader.stream.events.qsize()
    pool.clock.advance(0.05)
    await _settle()
    assert reader.stream.events.qsize() == num_queued and not reader.stream.finished, "held until its deadline"
    pool.clock.advance(0.1)
    with pytest.raises(errors.DeadlineExceeded, match="deadline passed after"):
        await reader.read()


async def test_held_sequences_with_a_deadline_outwait_the_orphan_grace(pool):
    """A replacement worker slower to start than --orphan-grace-ms (6.8 s on a loaded box) still
    gets the stream: the client's deadline, not the grace, bounds the hold."""
    grace_s = pool.config.orphan_grace_ms / 1000
    only = attach(pool, "w1", step_s=0.005)
    reader = submit(pool, "xyz", 30, deadline_s=pool.clock() + 6 * grace_s)
    head = await reader.read(until_tokens=5)
    detach(pool, only)
    await _settle()
    pool.clock.advance(2 * grace_s)
    await _settle()
    assert not reader.stream.finished and pool.queue_depth == 1, "held past the grace, within the deadline"
    attach(pool, "w2")
    tail = await reader.read()
    assert head + tail == expected("xyz", 30)


async def test_held_sequences_without_a_deadline_fail_after_the_orphan_grace(pool):
    only = attach(pool, "w1", step_s=0.005)
    reader = submit(pool, "abc", 30)
    await reader.read(until_tokens=2)
    detach(pool, only)
    await _settle()
    pool.clock.advance(pool.config.orphan_grace_ms / 1000)
    with pytest.raises(errors.Unavailable, match="no worker serves model toy-generator:1"):
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
    await until_turns(lambda: reader.stream.seq_id in worker.forgotten)
    assert pool.pressure().kv_usage == 0 and worker.num_steps < 100


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
    await until_turns(lambda: reader.stream.seq_id in worker.forgotten)
    assert await other.read() == expected("xyz", 20), "the other stream runs on untouched"
    assert pool.pressure().kv_usage == 0


async def test_a_continuation_streams_the_rest_from_its_index(pool):
    attach(pool, "w1")
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"),
                            seed=0, trace_context={},
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
                             seed=0, trace_context={},
                             arrival_s=pool.clock(), deadline_s=None)
    delivered = tuple(expected("abc", 2).encode())
    pool.submit(resumed, tuple(b"abc"), SamplingParams(max_tokens=6), delivered_token_ids=delivered)
    reader = Reader(resumed)
    reader.num_tokens = len(delivered)  # indices continue after the delivered tokens
    await reader.read()
    assert num_ttft() == before
    await submit(pool, "abc", 4).read()
    assert num_ttft() == before + 1
