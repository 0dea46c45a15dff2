"""A generator worker's last results and the end of its Attach stream, read by the scheduler together:
no token is lost (issue 35: a chaos run lost streams with INTERNAL "scheduler ... broke the stream:
chunk at index 97 does not continue the 96 tokens delivered").

A worker that leaves (it moves to an empty scheduler, or dies) answers the steps it holds and its
stream ends. The session's reader takes those StepResults and then the end of the stream in one run
and closes the link; the session's task detaches the worker (pool.remove_worker) only at its next
turn (attach_session.AttachSessions.serve). In between, the step loop woke on the answered results.
It used to apply them and plan more steps ahead, which the closed link refused, so its StepScheduler
held steps in flight that the loop did not: its next schedule() raised RuntimeError, the task died
with the last applied step's chunks never handed out, and the sequences, recomputed on the other
worker, went on one token further than their clients had: the gateway ends such a stream INTERNAL.
"""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler import attach_codec
from services.worker.mock_models import MockProfile, mock_continuation
from tests.unit.scheduler.conftest import until_turns
from tests.unit.scheduler.test_generate_pool_pipelined import MockWorker, make_pool, submit


class LeavingWorker(MockWorker):
    """Once `leaving`, the steps it is released to answer are computed and kept, then delivered all at
    once with the end of its stream (`answer_and_leave`), as the scheduler's reader sees a worker go."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, hold=True, **kwargs)
        self.leaving = False
        self.kept: list[tuple] = []

    async def _answer(self, steps, pending) -> None:
        if self.hold:
            gate = asyncio.get_running_loop().create_future()
            self.held.append(gate)
            await gate
        results = [await each for each in pending]
        if self.leaving:
            self.kept.append((steps, results))
            return
        self.num_in_flight -= len(steps)
        for step, result in zip(steps, results, strict=True):
            self.link.on_result(step.step_id, attach_codec.decode_step_result(result))

    def answer_and_leave(self) -> None:
        for steps, results in self.kept:
            for step, result in zip(steps, results, strict=True):
                self.link.on_result(step.step_id, attach_codec.decode_step_result(result))
        self.link.close()


@pytest.mark.parametrize("num_turns_before_detach", [0, 1, 5, 50])
async def test_a_worker_s_last_results_read_with_its_stream_s_end_lose_no_token(num_turns_before_detach):
    pool = make_pool(steps_per_command=4)
    leaving = LeavingWorker(pool, "w0", MockProfile())
    prompts = {seq_id: f"moving {seq_id}".encode() for seq_id in (1, 2, 3)}
    readers = {seq_id: submit(pool, seq_id, prompt, 40, temperature=0.5 if seq_id % 2 else 0.0)
               for seq_id, prompt in prompts.items()}
    # The first step alone, one ahead until its result, then decodes four to a command: two commands
    # of four in flight.
    await until_turns(lambda: leaving.command_sizes == [1, 1] and len(leaving.held) == 2)
    leaving.release_one()
    await until_turns(lambda: leaving.command_sizes == [1, 1, 4] and len(leaving.held) == 2)
    leaving.release_one()
    await until_turns(lambda: leaving.command_sizes == [1, 1, 4, 4] and len(leaving.held) == 2)
    other = MockWorker(pool, "w1", MockProfile())  # where the sequences go on
    loop = pool._loops[leaving.link.link_id]

    leaving.leaving = True
    leaving.release()
    await until_turns(lambda: len(leaving.kept) == 2)
    leaving.answer_and_leave()
    for _ in range(num_turns_before_detach):
        await asyncio.sleep(0)
    pool.remove_worker(leaving.link)

    for seq_id, reader in readers.items():
        seen = await reader.read()  # fails on a chunk that does not continue the tokens read
        seed = 1000 + seq_id if seq_id % 2 else 0
        assert seen.token_ids == mock_continuation(prompts[seq_id], 40, seed=seed), seq_id
    assert other.plans, "the streams finished on the other worker"
    await asyncio.wait_for(loop.task, timeout=5)
    assert loop.task.exception() is None
