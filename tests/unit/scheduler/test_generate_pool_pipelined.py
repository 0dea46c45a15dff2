"""GeneratePool with pipelined steps, against the real mock generator (services/worker/mock_models.py)
through the real Attach codecs on both sides, in process: step N+1 goes out before N's result,
streams are identical to `--pipelined-steps off`, and abort, preemption, worker loss and an old
worker that declares no max_steps_in_flight all still work."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from infermesh.v1 import scheduler_pb2
from services.scheduler import attach_codec
from services.scheduler.attach_types import AbortCommand, StepCommand, StepsCommand
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import FinishReason, SamplingParams
from services.scheduler.worker_link import WorkerLink
from services.worker.mock_models import MockGeneratorRuntime, MockProfile, mock_continuation
from tests.unit.scheduler.conftest import until_turns
from tools.testbed.fake_clock import FakeClock


async def _no_wait(_: float) -> None:
    await asyncio.sleep(0)


class MockWorker:
    """A mock generator behind a WorkerLink: each RunStep is encoded as the scheduler sends it,
    decoded and run by MockGeneratorRuntime, and answered at once, or when the test releases it."""

    def __init__(self, pool: GeneratePool, worker_id: str, profile: MockProfile, *, old: bool = False,
                 hold: bool = False) -> None:
        self.runtime = MockGeneratorRuntime("1", profile, sleep=_no_wait)
        wire = self.runtime.hello(worker_id)
        if old:  # a worker from before pipelined steps: the field is absent on the wire
            wire.capacity.ClearField("max_steps_in_flight")
        self.link = WorkerLink(attach_codec.decode_hello(wire))
        self.hold = hold
        self.held: list[asyncio.Future[None]] = []
        self.plans: list = []
        self.command_sizes: list[int] = []
        self.forgotten: set[int] = set()
        self.num_in_flight = self.max_in_flight = 0
        pool.add_worker(self.link)
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while (command := await self.link.next_command()) is not None:
            if isinstance(command, AbortCommand):
                self.forgotten.update(command.seq_ids)
                self.runtime.abort(scheduler_pb2.Abort(seq_ids=command.seq_ids))
            elif isinstance(command, StepCommand | StepsCommand):
                plans = (command.plan,) if isinstance(command, StepCommand) else command.plans
                self.plans.extend(plans)
                self.command_sizes.append(len(plans))
                for plan in plans:
                    self.forgotten.update(plan.finished_seq_ids)
                self.num_in_flight += len(plans)
                self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
                wire = attach_codec.encode_command(command)
                steps = (wire.run_step,) if wire.HasField("run_step") else tuple(wire.run_steps.steps)
                # Run in the order sent (the runtime mirrors each step as it is called), answered together.
                asyncio.create_task(self._answer(steps, [self.runtime.run_step(step) for step in steps]))

    async def _answer(self, steps: tuple[scheduler_pb2.RunStep, ...], pending: list) -> None:
        if self.hold:
            gate = asyncio.get_running_loop().create_future()
            self.held.append(gate)
            await gate
        results = [await each for each in pending]
        self.num_in_flight -= len(steps)
        for step, result in zip(steps, results, strict=True):
            self.link.on_result(step.step_id, attach_codec.decode_step_result(result))

    def release_one(self) -> None:
        self.held.pop(0).set_result(None)

    def release(self) -> None:
        self.hold = False
        for gate in self.held:
            gate.set_result(None)
        self.held.clear()

    def detach(self, pool: GeneratePool) -> None:
        self.link.close()
        pool.remove_worker(self.link)


def make_pool(pipelined: bool = True, steps_per_command: int = 1) -> GeneratePool:
    clock = FakeClock()
    hello = attach_codec.decode_hello(MockGeneratorRuntime("1", MockProfile()).hello("w"))
    config = SchedulerConfig(pipelined_steps=pipelined, steps_per_command=steps_per_command)
    return GeneratePool(hello.model, hello, config, clock=clock, sleep=clock.sleep)


@dataclasses.dataclass
class Stream:
    stream: GenerateStream
    token_ids: list[int] = dataclasses.field(default_factory=list)
    indexes: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish: object = None
    num_generated: int = 0

    async def read(self) -> Stream:
        while True:
            event = await asyncio.wait_for(self.stream.events.get(), timeout=5)
            if event.error is not None:
                raise event.error
            delta = event.delta
            assert delta.index == len(self.token_ids), "no token skipped or repeated"
            self.indexes.append(delta.index)
            self.token_ids.extend(delta.token_ids)
            self.text += delta.text
            if delta.is_last:
                self.finish, self.num_generated = delta.finish_reason, delta.num_generated
                return self

    def seen(self) -> tuple:
        return self.token_ids, self.indexes, self.text, self.finish, self.num_generated


def submit(pool: GeneratePool, seq_id: int, prompt: bytes, max_tokens: int, *, temperature: float = 0.0,
           stop: tuple[str, ...] = ()) -> Stream:
    stream = GenerateStream(seq_id=seq_id, tenant=TenantContext("t"), seed=1000 + seq_id, trace_context={},
                            arrival_s=pool.clock(), deadline_s=None)
    pool.submit(stream, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                      seed=1000 + seq_id if temperature else None, stop=stop))
    return Stream(stream)


async def test_step_n_plus_1_goes_out_before_the_result_of_step_n():
    pool = make_pool()
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    reader = submit(pool, 1, b"hello", 6)
    await until_turns(lambda: len(worker.plans) == 2)
    first, second = worker.plans
    assert worker.num_in_flight == 2 and not first.seqs[0].input_from_last_sample
    assert second.seqs[0].input_from_last_sample and second.seqs[0].token_ids == ()
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(worker.plans) == 2, "never more than two steps in flight"
    worker.release()
    assert (await reader.read()).token_ids == mock_continuation(b"hello", 6)


async def _run_mixed(pipelined: bool, profile: MockProfile, num_streams: int = 30,
                     steps_per_command: int = 1) -> tuple[dict, MockWorker]:
    pool = make_pool(pipelined, steps_per_command)
    worker = MockWorker(pool, "w0", profile)
    streams = {}
    for seq_id in range(1, num_streams + 1):
        if seq_id == num_streams // 2 + 1:  # a second wave while the first decodes
            await until_turns(lambda: len(worker.plans) >= 5)
        streams[seq_id] = submit(pool, seq_id, f"prompt {seq_id:03d}: ".encode() * (1 + seq_id % 3),
                                 max_tokens=2 + seq_id * 7 % 29, temperature=0.8 if seq_id % 2 else 0.0,
                                 stop=("q",) if seq_id % 3 == 0 else ())
    seen = {seq_id: (await reader.read()).seen() for seq_id, reader in streams.items()}
    await until_turns(lambda: worker.num_in_flight == 0)
    assert pool.kv_usage() == 0.0
    return seen, worker


@pytest.mark.parametrize("profile", [MockProfile(), MockProfile(num_kv_blocks=24, block_size=4, max_seq_len=96)],
                         ids=["roomy", "preempting"])
async def test_streams_are_identical_to_pipelined_steps_off(profile):
    pipelined, worker_on = await _run_mixed(True, profile)
    sequential, worker_off = await _run_mixed(False, profile)
    assert pipelined == sequential
    assert {seen[3] for seen in sequential.values()} == {FinishReason.STOP, FinishReason.LENGTH}
    assert worker_on.max_in_flight == 2 and worker_off.max_in_flight == 1
    num_ahead = sum(any(s.input_from_last_sample for s in p.seqs) for p in worker_on.plans)
    if profile.num_kv_blocks == 24:
        # Sequences wait for blocks most of the run: mostly one step at a time, some pipelined.
        assert any(p.preempted_seq_ids for p in worker_on.plans), "the small cache preempts"
        assert num_ahead > 0
    else:
        assert num_ahead > len(worker_on.plans) / 2


async def test_a_worker_that_declares_no_max_steps_in_flight_gets_one_step_at_a_time():
    pool = make_pool()
    worker = MockWorker(pool, "w0", MockProfile(), old=True)
    assert not pool._loops[worker.link.link_id].pipelined
    reader = submit(pool, 1, b"old worker", 12)
    assert (await reader.read()).token_ids == mock_continuation(b"old worker", 12)
    assert worker.max_in_flight == 1
    assert not any(s.input_from_last_sample for p in worker.plans for s in p.seqs)


async def test_aborting_with_two_steps_in_flight_frees_the_sequence_and_the_other_stream_goes_on():
    pool = make_pool()
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    gone, kept = submit(pool, 1, b"gone", 20), submit(pool, 2, b"kept", 20)
    await until_turns(lambda: worker.num_in_flight == 2)
    pool.abort(gone.stream)
    worker.release()
    assert (await kept.read()).token_ids == mock_continuation(b"kept", 20)
    await until_turns(lambda: 1 in worker.forgotten and worker.num_in_flight == 0)
    assert pool.kv_usage() == 0.0 and gone.stream.events.empty()


async def test_a_worker_lost_with_two_steps_in_flight_loses_no_stream():
    pool = make_pool()
    first = MockWorker(pool, "w0", MockProfile(), hold=True)
    readers = [submit(pool, seq_id, f"lost {seq_id}".encode(), 15, temperature=0.5) for seq_id in (1, 2, 3)]
    await until_turns(lambda: len(first.held) == 2)
    first.release_one()  # step 1's result: its tokens are streamed, step 3 goes out behind step 2
    await until_turns(lambda: len(first.plans) == 3 and len(first.held) == 2)
    assert first.plans[2].seqs[0].input_from_last_sample
    second = MockWorker(pool, "w1", MockProfile())
    first.detach(pool)
    for seq_id, reader in zip((1, 2, 3), readers, strict=True):
        seen = await reader.read()
        expected = mock_continuation(f"lost {seq_id}".encode(), 15, seed=1000 + seq_id)
        assert seen.token_ids == expected, seq_id
    assert second.plans, "the streams finished on the other worker"
    first.release()  # the dead stream's answers go nowhere


@pytest.mark.parametrize("profile", [MockProfile(), MockProfile(num_kv_blocks=24, block_size=4, max_seq_len=96)],
                         ids=["roomy", "preempting"])
async def test_several_steps_per_command_stream_what_one_step_at_a_time_does(profile):
    batched, worker = await _run_mixed(True, profile, steps_per_command=4)
    sequential, _ = await _run_mixed(False, profile)
    assert batched == sequential
    assert max(worker.command_sizes) <= 4 and worker.max_in_flight <= 8
    if profile.num_kv_blocks != 24:
        assert max(worker.command_sizes) == 4, "decodes with nothing waiting go four to a command"


async def test_the_first_step_goes_alone_then_decodes_go_four_to_a_command():
    pool = make_pool(steps_per_command=4)
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    reader = submit(pool, 1, b"burst", 20)
    # One step ahead until the first result (streams arriving together join at the third step).
    await until_turns(lambda: worker.command_sizes == [1, 1] and len(worker.held) == 2)
    worker.release_one()  # the first step's result: decodes go four to a command from now on
    await until_turns(lambda: worker.command_sizes == [1, 1, 4] and len(worker.held) == 2)
    prefill, *ahead = worker.plans
    assert not prefill.seqs[0].input_from_last_sample, "the first token comes back after one step"
    assert [p.seqs[0].start_position for p in ahead] == [len(b"burst") + i for i in range(5)]
    assert [p.seqs[0].num_generated for p in ahead] == [1, 2, 3, 4, 5]
    assert all(p.seqs[0].input_from_last_sample and p.seqs[0].token_ids == () for p in ahead)
    worker.release_one()  # the second step's result: no command's step time known yet, four more at once
    await until_turns(lambda: worker.command_sizes == [1, 1, 4, 4] and len(worker.held) == 2)
    pool.clock.advance(0.004)  # the first command of four takes 4 ms: 1 ms a step
    worker.release_one()
    for _ in range(50):
        await asyncio.sleep(0)
    # Four steps in flight, the worker 1 ms a step: the next four leave when it has one step and the
    # lead (1 ms) left, 2 ms from now, not at once.
    assert worker.command_sizes == [1, 1, 4, 4]
    pool.clock.advance(0.0021)
    await until_turns(lambda: worker.command_sizes == [1, 1, 4, 4, 4])
    worker.release()
    assert (await reader.read()).token_ids == mock_continuation(b"burst", 20)
    assert sum(len(p.seqs) for p in worker.plans) == 20, "no step beyond max_tokens"


async def idle_after_a_step(pool, worker: MockWorker, step_s: float) -> None:
    """One stream of one token whose step took `step_s` (the step time gather scales by), then idle."""
    warm = submit(pool, 1, b"warm", 1)
    await until_turns(lambda: len(worker.held) == 1)
    pool.clock.advance(step_s)
    worker.release_one()
    await warm.read()
    await until_turns(lambda: not pool._loops[worker.link.link_id]._in_flight)


async def test_streams_arriving_just_after_an_idle_spell_share_the_step_behind_the_first():
    pool = make_pool(steps_per_command=4)
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    await idle_after_a_step(pool, worker, 0.040)
    first = submit(pool, 2, b"first", 8)
    for _ in range(50):
        await asyncio.sleep(0)
    pool.clock.advance(0.0041)  # nobody else within 4 ms (StepPacing.gather): the first step goes alone
    await until_turns(lambda: len(worker.held) == 1)
    pool.clock.advance(0.003)  # the others land a few ms behind the first
    others = [submit(pool, seq_id, f"other {seq_id}".encode(), 8) for seq_id in (3, 4)]
    for _ in range(50):
        await asyncio.sleep(0)
    assert worker.command_sizes == [1, 1], "the step behind the first is not sent at once"
    pool.clock.advance(0.018)  # half the last step time into the first
    await until_turns(lambda: len(worker.held) == 2)
    behind = worker.plans[-1]
    assert {s.seq_id for s in behind.seqs} == {2, 3, 4}, "the first one's decode beside the others' prefills"
    worker.release()
    assert (await first.read()).token_ids == mock_continuation(b"first", 8)
    for seq_id, reader in zip((3, 4), others, strict=True):
        assert (await reader.read()).token_ids == mock_continuation(f"other {seq_id}".encode(), 8)


async def test_streams_arriving_together_after_an_idle_spell_start_in_one_step():
    pool = make_pool(steps_per_command=4)
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    await idle_after_a_step(pool, worker, 0.040)
    readers = {}
    for seq_id in (2, 3, 4):  # 2 ms apart
        readers[seq_id] = submit(pool, seq_id, f"together {seq_id}".encode(), 6)
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(worker.plans) == 1, "the first step waits while they keep arriving"
        pool.clock.advance(0.002)
    pool.clock.advance(0.0021)  # 4 ms with nobody new
    await until_turns(lambda: len(worker.plans) == 2)
    assert {s.seq_id for s in worker.plans[1].seqs} == {2, 3, 4}
    worker.release()
    for seq_id, reader in readers.items():
        assert (await reader.read()).token_ids == mock_continuation(f"together {seq_id}".encode(), 6)


async def test_a_new_worker_loop_sends_its_first_step_at_once_while_streams_keep_arriving():
    # A restarted scheduler's first generator worker: no step time is known, so StepPacing.gather waits
    # for nobody (the clock never moves here: a wait on it would never end).
    pool = make_pool(steps_per_command=4)
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    readers = {1: submit(pool, 1, b"resumed 1", 4)}
    await until_turns(lambda: len(worker.plans) >= 1)  # at once
    readers.update((seq_id, submit(pool, seq_id, f"resumed {seq_id}".encode(), 4)) for seq_id in (2, 3))
    assert {s.seq_id for s in worker.plans[0].seqs} == {1}, "the first arrival's step went alone"
    worker.release()
    for seq_id, reader in readers.items():
        assert (await reader.read()).token_ids == mock_continuation(f"resumed {seq_id}".encode(), 4)


async def test_a_waiting_sequence_makes_the_loop_send_one_step_at_a_time():
    pool = make_pool(steps_per_command=4)
    profile = MockProfile(max_num_seqs=1)
    worker = MockWorker(pool, "w0", profile)
    first, second = submit(pool, 1, b"running", 10), submit(pool, 2, b"waiting", 10)
    assert (await first.read()).token_ids == mock_continuation(b"running", 10)
    assert (await second.read()).token_ids == mock_continuation(b"waiting", 10)
    second_starts = next(i for i, plan in enumerate(worker.plans) if any(s.seq_id == 2 for s in plan.seqs))
    sizes, num_plans = [], 0
    for size in worker.command_sizes:
        if num_plans >= second_starts:
            break
        sizes.append(size)
        num_plans += size
    assert len(sizes) >= 9 and set(sizes) == {1}, "while one waits, every step goes alone"
    assert max(worker.command_sizes) == 4, "alone, the second one's decodes go four to a command"


async def test_a_newcomer_goes_right_behind_a_command_of_several_steps():
    pool = make_pool(steps_per_command=4)
    worker = MockWorker(pool, "w0", MockProfile(), hold=True)
    first = submit(pool, 1, b"decoding", 12)
    await until_turns(lambda: worker.command_sizes == [1, 1] and len(worker.held) == 2)
    worker.release_one()
    await until_turns(lambda: worker.command_sizes == [1, 1, 4])
    second = submit(pool, 2, b"newcomer", 6)
    await until_turns(lambda: worker.command_sizes == [1, 1, 4, 1])
    behind = worker.plans[-1]
    assert {s.seq_id for s in behind.seqs} == {1, 2}, "its prefill, beside the running one's next decode"
    assert not [s for s in behind.seqs if s.seq_id == 2][0].input_from_last_sample
    worker.release()
    assert (await first.read()).token_ids == mock_continuation(b"decoding", 12)
    assert (await second.read()).token_ids == mock_continuation(b"newcomer", 6)
