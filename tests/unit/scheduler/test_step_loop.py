"""WorkerLoop without a pool: a StepScheduler, a fake worker over WorkerLink, and a sink that records
what the loop reports (the StepSink seam is all it knows of a pool). Fake clock; no wall time."""

from __future__ import annotations

import asyncio

from services.scheduler import metrics
from services.scheduler.attach_types import StepOutcome
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_loop import _BLOCKED_POLL_S, WorkerLoop
from services.scheduler.step_plan import SequenceDelta, StepPlan
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.step_scheduler_config import step_scheduler_config
from services.scheduler.worker_link import WorkerLink
from tests.unit.scheduler.conftest import TOKENIZER, until_turns
from tests.unit.scheduler.test_generate_pool import FakeWorker, expected, hello


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []  # ("planned" | "completed", step_id)
        self.deltas: list[SequenceDelta] = []

    def planned(self, plan: StepPlan) -> None:
        self.calls.append(("planned", plan.step_id))

    def completed(self, plan: StepPlan, outcome: StepOutcome, deltas: list[SequenceDelta]) -> None:
        self.calls.append(("completed", plan.step_id))
        self.deltas.extend(deltas)


def make_loop(clock) -> tuple[WorkerLoop, RecordingSink, FakeWorker]:
    """One step at a time: the fake worker computes each step's input from its token ids."""
    link = WorkerLink(hello("w0"))
    capacity = link.hello.capacity
    scheduler = StepScheduler(step_scheduler_config(SchedulerConfig(), capacity),
                              KVBlockManager(capacity.num_kv_blocks, capacity.block_size), TOKENIZER, clock)
    sink = RecordingSink()
    loop = WorkerLoop(link, scheduler, sink, sequences={}, step_metrics=metrics.StepMetrics("test-loop"),
                      pipelined=False, steps_per_command=1, clock=clock, sleep=clock.sleep)
    return loop, sink, FakeWorker(link, clock)


async def settle(num_turns: int = 50) -> None:
    """Lets the loop run until it waits (on the clock, or for an arrival)."""
    for _ in range(num_turns):
        await asyncio.sleep(0)


def text_of(deltas: list[SequenceDelta], seq_id: int) -> str:
    return "".join(d.text for d in deltas if d.seq_id == seq_id)


async def test_the_loop_reports_every_step_planned_then_completed_and_streams_all_tokens(clock):
    loop, sink, worker = make_loop(clock)
    loop.scheduler.add_request(1, tuple(b"abc"), SamplingParams(max_tokens=5), TenantContext("t"), deadline_s=None)
    loop.wake()
    await until_turns(lambda: any(d.is_last for d in sink.deltas))
    assert text_of(sink.deltas, 1) == expected("abc", 5)
    completed = [step_id for kind, step_id in sink.calls if kind == "completed"]
    assert len(completed) == len(set(completed)) == worker.num_steps == 5
    for step_id in completed:
        assert sink.calls.index(("planned", step_id)) < sink.calls.index(("completed", step_id))
    # The step after the last one runs nothing: planned (it may expire sequences), never sent; the
    # worker is told to forget the finished sequence instead.
    await until_turns(lambda: 1 in worker.forgotten)
    assert ("planned", completed[-1] + 1) in sink.calls
    assert ("completed", completed[-1] + 1) not in sink.calls
    loop.attached = False
    loop.wake()
    await asyncio.wait_for(loop.task, timeout=5)


async def test_a_draining_worker_s_loop_ends_its_stream_once_nothing_is_left(clock):
    loop, sink, worker = make_loop(clock)
    loop.scheduler.add_request(1, tuple(b"xy"), SamplingParams(max_tokens=3), TenantContext("t"), deadline_s=None)
    loop.link.draining = True
    loop.wake()
    await asyncio.wait_for(loop.task, timeout=5)
    assert text_of(sink.deltas, 1) == expected("xy", 3)
    await asyncio.wait_for(worker.task, timeout=5)  # its command stream ended: the worker's reader returns


async def test_a_loop_with_work_it_may_not_run_looks_again_every_blocked_poll_and_runs_it_once_it_may(clock):
    """Admission blocked (here: every KV block held elsewhere): the loop plans an empty step, waits
    _BLOCKED_POLL_S on its clock and plans again, without spinning and without needing a wake(); once the
    blocks are free its next look runs the sequence."""
    loop, sink, worker = make_loop(clock)
    kv = loop.scheduler.kv
    kv.allocate(999, kv.num_free_blocks * kv.block_size)  # a phantom sequence holds every block
    assert kv.num_free_blocks == 0
    loop.scheduler.add_request(1, tuple(b"abc"), SamplingParams(max_tokens=2), TenantContext("t"), deadline_s=None)
    loop.wake()
    await until_turns(lambda: len(sink.calls) >= 1)
    await settle()
    looks = len(sink.calls)
    assert looks <= 2, "no spinning while the clock stands still"
    assert all(kind == "planned" for kind, _ in sink.calls) and worker.num_steps == 0
    clock.advance(_BLOCKED_POLL_S)
    await until_turns(lambda: len(sink.calls) > looks)
    assert worker.num_steps == 0, "still blocked: looked again, ran nothing"
    await settle()  # it waits again
    kv.free(999)
    clock.advance(_BLOCKED_POLL_S)  # no wake(): the poll finds the blocks free
    await until_turns(lambda: any(d.is_last for d in sink.deltas))
    assert text_of(sink.deltas, 1) == expected("abc", 2)
    loop.attached = False
    loop.wake()
    await asyncio.wait_for(loop.task, timeout=5)
