"""bench/scheduler/static_batching.py: the continuous-batching benchmark's static baseline, a StepScheduler
subclass, on the scheduler's own fake workers and fake clock."""

from __future__ import annotations

import functools

import pytest

from bench.scheduler.static_batching import StaticBatchScheduler, split_padding_flag
from tests.unit.scheduler.conftest import (
    FakePagedWorker,
    fake_next_token,
    first_step_of_each_sequence,
    make_prompt,
    make_requests,
    make_scheduler,
)
from tools.testbed.fake_clock import FakeClock

PADDED = functools.partial(StaticBatchScheduler, padding=True)
UNPADDED = functools.partial(StaticBatchScheduler, padding=False)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def expected_tokens(seq_id: int, prompt_len: int, max_tokens: int) -> list[int]:
    context = list(make_prompt(seq_id, prompt_len))
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(fake_next_token(context + out))
    return out


def test_static_batching_admits_nothing_new_until_the_whole_running_set_finished(clock):
    # Sequence 1 finishes after step 1, but 3 only starts once 2 (six tokens) is done too.
    assert first_step_of_each_sequence(clock, factory=PADDED) == {1: 0, 2: 0, 3: 6}


def test_static_batching_pads_a_finished_member_until_the_batch_ends(clock):
    scheduler = make_scheduler(clock, max_num_seqs=2, factory=PADDED)
    worker = FakePagedWorker(4)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=2)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=6, first_id=2)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=2, first_id=3)
    streamed: dict[int, list[int]] = {1: [], 2: [], 3: []}
    plans = []
    for _ in range(12):
        plan = scheduler.schedule()
        if not plan.has_work():
            break
        plans.append(plan)
        for delta in scheduler.update_from_output(plan, worker.run(plan)):
            streamed[delta.seq_id].extend(delta.token_ids)
    # Steps 0-1 run 1 and 2; 1 is done after step 1 but its slot is computed through step 5, recomputing
    # its last cached position (4 prompt + 1 generated tokens -> position 4) with nothing streamed.
    for plan in plans[2:6]:
        pad = next(s for s in plan.seqs if s.seq_id == 1)
        assert (pad.start_position, len(pad.token_ids), pad.new_blocks, pad.sample) == (4, 1, (), True)
    assert 1 not in plans[5].finished_seq_ids and 1 in plans[6].finished_seq_ids  # released with the batch
    assert [s.seq_id for s in plans[6].seqs] == [3]
    for seq_id, max_tokens in ((1, 2), (2, 6), (3, 2)):
        assert streamed[seq_id] == list(expected_tokens(seq_id, 4, max_tokens))
    assert scheduler.kv.num_used_blocks == 0


def test_static_batching_without_padding_drops_finished_members(clock):
    assert first_step_of_each_sequence(clock, factory=UNPADDED) == {1: 0, 2: 0, 3: 6}


def test_the_padding_flag_is_taken_out_of_the_schedulers_flags():
    assert split_padding_flag(["--port", "1", "--static-batch-padding", "false", "--plaintext"]) == (
        False, ["--port", "1", "--plaintext"])
    assert split_padding_flag(["--port", "1"]) == (True, ["--port", "1"])
    with pytest.raises(SystemExit, match="takes true or false"):
        split_padding_flag(["--static-batch-padding", "maybe"])
