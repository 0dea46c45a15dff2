"""Builders, a fake clock and a fake paged worker for the scheduler's logic tests."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import defaultdict
from collections.abc import Callable

import pytest

from services.scheduler.dynamic_batcher import BatcherConfig, DynamicBatcher
from services.scheduler.fair_queue import Priority, TenantContext
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import SamplingParams
from services.scheduler.step_plan import SequenceDelta, StepPlan
from services.scheduler.step_scheduler import StepScheduler, StepSchedulerFactory
from services.scheduler.step_scheduler_config import StepSchedulerConfig
from services.scheduler.tokenizer import ByteTokenizer
from tools.testbed.fake_clock import FakeClock  # noqa: F401 - re-exported to the tests

EOS = 256
TOKENIZER = ByteTokenizer(vocab_size=257, eos_token_id=EOS)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def tenant(tenant_id: str = "acme", priority: Priority = Priority.STANDARD, weight: int = 1) -> TenantContext:
    return TenantContext(tenant_id, priority, weight)


def arrivals_per_tick(rate_per_s: float, duration_s: float, tick_s: float, seed: int) -> list[int]:
    """Poisson arrivals counted per tick, seeded so every run gets the same: open-loop load with its
    bursts, as the benchmarks send it."""
    rng = random.Random(seed)
    counts = [0] * round(duration_s / tick_s)
    at_s = rng.expovariate(rate_per_s)
    while at_s < duration_s:
        counts[int(at_s / tick_s)] += 1
        at_s += rng.expovariate(rate_per_s)
    return counts


# -- classify -----------------------------------------------------------------


def make_batcher(clock: FakeClock, *, workers: dict[str, int] | None = None, **over) -> DynamicBatcher:
    """A batcher with one worker "w1" of max batch 8 unless `workers` says otherwise."""
    config = dataclasses.replace(
        BatcherConfig(max_batch_size=8, max_queue_delay_s=0.010, initial_batch_time_s=0.020), **over
    )
    batcher: DynamicBatcher = DynamicBatcher(config, clock)
    for worker_id, max_batch_size in (workers if workers is not None else {"w1": 8}).items():
        batcher.add_worker(worker_id, max_batch_size)
    return batcher


# -- generate -----------------------------------------------------------------


def make_scheduler(clock: FakeClock, *, num_blocks: int = 64, block_size: int = 4,
                   factory: StepSchedulerFactory = StepScheduler, **over) -> StepScheduler:
    """`factory`: StepScheduler or a subclass's constructor (bench/scheduler/static_batching.py)."""
    config = dataclasses.replace(
        StepSchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_seq_len=128, kv_watermark=0.0), **over
    )
    return factory(config, KVBlockManager(num_blocks, block_size), TOKENIZER, clock)


def first_step_of_each_sequence(clock: FakeClock, **over) -> dict[int, int]:
    """Three sequences (2, 6 and 2 tokens to generate) through two slots: the step each first ran in."""
    scheduler = make_scheduler(clock, max_num_seqs=2, **over)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=2)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=6, first_id=2)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=2, first_id=3)
    admitted_at: dict[int, int] = {}
    for step in range(12):
        plan = scheduler.schedule()
        for s in plan.seqs:
            admitted_at.setdefault(s.seq_id, step)
        if plan.has_work():
            scheduler.update_from_output(plan, worker.run(plan))
    return admitted_at


def make_prompt(seq_index: int, prompt_len: int) -> tuple[int, ...]:
    return tuple(97 + (seq_index * 7 + i) % 26 for i in range(prompt_len))


def make_requests(
    scheduler: StepScheduler,
    n: int,
    *,
    prompt_len: int = 8,
    max_tokens: int = 8,
    first_id: int = 1,
    who: TenantContext | None = None,
    deadline_s: float | None = None,
    **sampling,
) -> list[int]:
    """Adds `n` sequences with distinct deterministic prompts; returns their ids."""
    ids = []
    for seq_id in range(first_id, first_id + n):
        scheduler.add_request(
            seq_id,
            make_prompt(seq_id, prompt_len),
            SamplingParams(max_tokens=max_tokens, **sampling),
            who or tenant(),
            deadline_s=deadline_s,
        )
        ids.append(seq_id)
    return ids


def fake_next_token(context: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole context, like attention."""
    return 97 + (sum(context) * 31 + len(context) * 17) % 26


class FakePagedWorker:
    """Executes StepPlans the way a real worker must: it keeps block tables from
    reset/new_blocks/finished ids, writes each computed token into its KV slot, and
    samples from the context read back out of the blocks. A reset table starts with
    `num_cached_tokens` positions read from whatever its reused blocks hold (the prefix
    cache). Wrong block tables, a reused block holding other tokens, or a block written
    while another live sequence holds it change the sampled tokens or raise."""

    def __init__(self, block_size: int, next_token=fake_next_token) -> None:
        self.block_size = block_size
        self.next_token = next_token
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}
        self.slots: dict[int, list[int | None]] = defaultdict(lambda: [None] * block_size)
        self.num_steps = 0

    def run(self, plan: StepPlan) -> dict[int, int]:
        self.num_steps += 1
        for seq_id in plan.finished_seq_ids:
            self.tables.pop(seq_id, None)
            self.num_cached.pop(seq_id, None)
        in_step = {s.seq_id for s in plan.seqs}
        if in_step & set(plan.finished_seq_ids):
            raise AssertionError("a sequence is both finished and scheduled in one plan")
        sampled = {}
        for step in plan.seqs:
            if step.reset_block_table:
                self.tables[step.seq_id] = []
                self.num_cached[step.seq_id] = step.num_cached_tokens
            table = self.tables[step.seq_id]
            table.extend(step.new_blocks)
            # Like the real worker: a step may recompute cached positions, never skip any.
            if step.start_position > self.num_cached[step.seq_id]:
                raise AssertionError(f"seq {step.seq_id}: start {step.start_position}, cached {self.num_cached}")
            end = step.start_position + len(step.token_ids)
            self._check_exclusive(step.seq_id, {table[p // self.block_size] for p in range(step.start_position, end)})
            for offset, token_id in enumerate(step.token_ids):
                position = step.start_position + offset
                self.slots[table[position // self.block_size]][position % self.block_size] = token_id
            self.num_cached[step.seq_id] = step.start_position + len(step.token_ids)
            if step.sample:
                sampled[step.seq_id] = self.next_token(self._context(step.seq_id))
        return sampled

    def _context(self, seq_id: int) -> list[int]:
        table = self.tables[seq_id]
        return [self.slots[table[p // self.block_size]][p % self.block_size] for p in range(self.num_cached[seq_id])]

    def _check_exclusive(self, seq_id: int, written: set[int]) -> None:
        """Blocks a step writes belong to its sequence alone (shared prefix blocks are only read)."""
        for other, table in self.tables.items():
            if other != seq_id and written & set(table):
                raise AssertionError(f"blocks {written & set(table)} written by seq {seq_id}, held by {other}")


@dataclasses.dataclass
class Transcript:
    """Everything streamed per sequence, and the plans that produced it."""

    deltas: dict[int, list[SequenceDelta]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    plans: list[StepPlan] = dataclasses.field(default_factory=list)

    def token_ids(self, seq_id: int) -> list[int]:
        return [t for d in self.deltas[seq_id] for t in d.token_ids]

    def text(self, seq_id: int) -> str:
        return "".join(d.text for d in self.deltas[seq_id])

    def last(self, seq_id: int) -> SequenceDelta:
        return self.deltas[seq_id][-1]


def run_steps(
    scheduler: StepScheduler,
    worker: FakePagedWorker,
    clock: FakeClock,
    *,
    max_steps: int = 1000,
    step_s: float = 0.01,
    transcript: Transcript | None = None,
) -> Transcript:
    """Drives schedule -> run -> update_from_output until nothing is left (or max_steps)."""
    transcript = transcript or Transcript()
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
        plan = scheduler.schedule()
        transcript.plans.append(plan)
        if not plan.has_work():
            continue
        sampled = worker.run(plan)
        clock.advance(step_s)
        for delta in scheduler.update_from_output(plan, sampled):
            transcript.deltas[delta.seq_id].append(delta)
    return transcript


def assert_contiguous(transcript: Transcript, seq_id: int) -> None:
    """Chunk indexes leave no gap and no overlap."""
    expected = 0
    for delta in transcript.deltas[seq_id]:
        assert delta.index == expected, f"seq {seq_id}: chunk at {delta.index}, expected {expected}"
        expected += len(delta.token_ids)


async def until_turns(condition: Callable[[], bool], max_turns: int = 2000) -> None:
    """Lets the event loop run until `condition()` holds (fake workers answer within a few turns)."""
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached in {max_turns} event-loop turns")
