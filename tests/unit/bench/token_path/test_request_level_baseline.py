"""The request-level batching peer of the token fast path benchmark, over a fake step runner."""

from __future__ import annotations

import asyncio

import pytest

from bench.token_path.request_level_baseline import RequestLevelBatcher, closed_loop, open_loop
from bench.token_path.workload import TokenRequest
from services.worker.work import RunStep, SequenceOutput, StageDurations
from tools.testbed.fake_clock import FakeClock


class FakeRunner:
    """Answers every sequence with token 100 + its position; records steps and forgotten ids."""

    block_size = 4
    num_kv_blocks = 64

    def __init__(self) -> None:
        self.steps: list[RunStep] = []
        self.forgotten: list[int] = []

    def run(self, step: RunStep):
        self.steps.append(step)
        outputs = [SequenceOutput(s.seq_id, token_id=100 + s.start_position + len(s.token_ids)) for s in step.seqs]
        return outputs, StageDurations()

    def forget(self, seq_ids):
        self.forgotten.extend(seq_ids)


def test_members_drop_out_when_done_and_a_new_batch_waits_for_the_previous_to_end():
    async def scenario():
        runner = FakeRunner()
        batcher = RequestLevelBatcher(runner, max_batch_size=2)
        short = batcher.submit((1, 2), 1)
        long = batcher.submit((1, 2, 3), 3)
        late = batcher.submit((5,), 2)  # third: waits for the whole first batch
        engine = asyncio.create_task(batcher.serve_forever())
        assert await long.done == [103, 104, 105]
        assert await short.done == [102]
        assert await late.done == [101, 102]
        engine.cancel()
        return runner

    runner = asyncio.run(scenario())
    sizes = [len(step.seqs) for step in runner.steps]
    assert sizes == [2, 1, 1, 1, 1]  # short left after the prefill; late started only after long ended
    prefill = runner.steps[0].seqs
    assert [s.token_ids for s in prefill] == [(1, 2), (1, 2, 3)]
    assert prefill[0].new_blocks == (0,) and prefill[1].new_blocks == (1, 2)  # 2+1 and 3+3 positions, 4 a block
    decode = runner.steps[1].seqs[0]
    assert (decode.token_ids, decode.start_position, decode.num_generated) == ((103,), 3, 1)
    assert sorted(runner.forgotten) == [s.seq_id for s in prefill] + [runner.steps[3].seqs[0].seq_id]


def test_refuses_an_empty_prompt_and_a_zero_batch():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        RequestLevelBatcher(FakeRunner(), max_batch_size=0)

    async def empty():
        RequestLevelBatcher(FakeRunner()).submit((), 4)

    with pytest.raises(ValueError, match="need a prompt and max_tokens >= 1, got 0 tokens and 4"):
        asyncio.run(empty())


def test_open_loop_times_count_from_the_scheduled_send():
    clock = FakeClock()

    async def scenario():
        batcher = RequestLevelBatcher(FakeRunner(), clock=clock)
        engine = asyncio.create_task(batcher.serve_forever())
        results = await open_loop(batcher, [TokenRequest(0.0, "ab", 2), TokenRequest(0.0, "c", 3)],
                                  lambda text: tuple(text.encode()), clock)
        engine.cancel()
        return results

    results = asyncio.run(scenario())
    assert [(r.num_tokens, r.ok, r.scheduled_s) for r in results] == [(2, True, 0.0), (3, True, 0.0)]
    assert all(r.ttft_s == 0.0 and r.done_s == 0.0 for r in results)  # the fake clock never moved


def test_closed_loop_keeps_its_clients_busy_until_the_window_ends():
    clock = FakeClock()

    class TickingRunner(FakeRunner):
        def run(self, step):
            clock.advance(0.01)
            return super().run(step)

    async def scenario():
        batcher = RequestLevelBatcher(TickingRunner(), clock=clock)
        engine = asyncio.create_task(batcher.serve_forever())
        results, elapsed_s = await closed_loop(batcher, [TokenRequest(0.0, "ab", 4)], 3, 0.5,
                                               lambda text: tuple(text.encode()), clock)
        engine.cancel()
        return results, elapsed_s

    results, elapsed_s = asyncio.run(scenario())
    # 3 clients in one batch, 4 steps of 10 ms each: every 40 ms three 4-token streams end.
    assert len(results) == 3 * 12 and all(r.num_tokens == 4 for r in results)
    assert all(r.done_s <= 0.5 for r in results)
    assert elapsed_s == pytest.approx(0.52)
