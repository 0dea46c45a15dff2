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
from services.scheduler.step_loop import WorkerLoop
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
