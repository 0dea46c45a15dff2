"""The worker's side of pipelined steps: a step sent before the last one's result takes each
decode's input from the token sampled for it last (SequenceStep.input_from_last_sample), the same
for the sequence mirror, the model's StepExecutor, the mock generator and the protobuf codec."""

from __future__ import annotations

import asyncio

import grpc

from infermesh.v1 import common_pb2, scheduler_pb2
from services.worker.attach_client import AttachClient, Backoff
from services.worker.mock_models import MockGeneratorRuntime, MockProfile, mock_continuation
from services.worker.repository.loader import LoadedModel
from services.worker.sequence_mirror import MAX_STEPS_IN_FLIGHT, SequenceMirror
from services.worker.step_codec import run_step_from_proto
from services.worker.step_executor import StepExecutor
from services.worker.work import ErrorCode, RunStep, SamplingParams, SequenceStep

from .fake_runtimes import FakeStepRuntime
from .test_mock_models import seq_step


def _from_last(seq_id: int, start: int, new_blocks=(), num_generated: int = 1, **sampling) -> SequenceStep:
    return SequenceStep(seq_id, (), start, new_blocks, sample=True, sampling=SamplingParams(**sampling),
                        num_generated=num_generated, input_from_last_sample=True)


def test_the_mirror_fills_in_the_last_sample_and_refuses_a_step_without_one():
    mirror = SequenceMirror(num_kv_blocks=8, block_size=4, vocab_size=257, max_seq_len=64)
    first = mirror.admit_step(RunStep(1, (
        SequenceStep(1, (97, 98, 99), 0, (0,), reset_block_table=True, sample=True),
        SequenceStep(2, (97, 98), 0, (1,), reset_block_table=True, sample=False),
    )))
    one, two = first.admitted
    mirror.computed(one, 120)
    mirror.computed(two)
    second = mirror.admit_step(RunStep(2, (
        _from_last(1, 3),
        _from_last(2, 2),  # its last step sampled nothing
        _from_last(3, 0),  # unknown here
        SequenceStep(1, (5,), 4, input_from_last_sample=True),  # a repeat, and token ids besides
    )))
    (admitted,) = second.admitted
    assert admitted.step.token_ids == (120,) and admitted.end_position == 4
    assert sorted(second.refused) == [1, 2, 3]
    assert all(out.error.code == ErrorCode.INVALID_ARGUMENT for out in second.refused.values())
    assert "sampled no token" in second.refused[1].error.message


def test_token_ids_or_a_reset_with_input_from_last_sample_are_refused():
    mirror = SequenceMirror(num_kv_blocks=8, block_size=4, vocab_size=257, max_seq_len=64)
    (one,) = mirror.admit_step(RunStep(1, (SequenceStep(1, (97,), 0, (0,), reset_block_table=True, sample=True),))).admitted
    mirror.computed(one, 98)
    refused = mirror.admit_step(RunStep(2, (
        SequenceStep(1, (98,), 1, sample=True, input_from_last_sample=True),
    ))).refused
    assert "token_ids" in refused[0].error.message
    refused = mirror.admit_step(RunStep(3, (
        SequenceStep(2, (), 0, (1,), reset_block_table=True, sample=True, input_from_last_sample=True),
    ))).refused
    assert "reset_block_table" in refused[0].error.message


def test_the_executor_samples_the_same_pipelined_as_one_step_at_a_time(tinylm: LoadedModel):
    prompt = (257, *b"The value of ")
    sampling = {"temperature": 0.8, "seed": 7}

    def run(pipelined: bool) -> list[int]:
        executor = StepExecutor(tinylm.generator, 16, 8, seed_source=lambda: 1)
        outputs, _ = executor.run(RunStep(1, (SequenceStep(1, prompt, 0, (0, 1), reset_block_table=True, sample=True,
                                                           sampling=SamplingParams(**sampling)),)))
        tokens = [outputs[0].token_id]
        for n in range(1, 10):
            position = len(prompt) + n - 1
            new = (2 + position // 8,) if position % 8 == 0 else ()
            step = (_from_last(1, position, new, num_generated=n, **sampling) if pipelined else
                    SequenceStep(1, (tokens[-1],), position, new, sample=True, sampling=SamplingParams(**sampling),
                                 num_generated=n))
            outputs, _ = executor.run(RunStep(1 + n, (step,)))
            assert outputs[0].error is None, outputs[0].error
            tokens.append(outputs[0].token_id)
        return tokens

    assert run(True) == run(False)


def test_the_codec_carries_the_flag():
    command = scheduler_pb2.RunStep(step_id=4, seqs=[scheduler_pb2.SequenceStep(
        seq_id=1, start_position=3, sample=True, input_from_last_sample=True)])
    (step,) = run_step_from_proto(command).seqs
    assert step.input_from_last_sample and step.token_ids == ()


class GatedSleep:
    """Stands in for asyncio.sleep: each delay lasts until the test opens its gate."""

    def __init__(self) -> None:
        self.pending: list[asyncio.Future[None]] = []
        self.delays_s: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)
        gate = asyncio.get_running_loop().create_future()
        self.pending.append(gate)
        await gate


def test_the_mock_declares_steps_in_flight_and_runs_them_one_after_the_other():
    sleep = GatedSleep()
    runtime = MockGeneratorRuntime("1", MockProfile(step_ms=5, num_kv_blocks=8, block_size=4, max_seq_len=64),
                                   sleep=sleep)
    capacity = runtime.hello("w").capacity
    assert capacity.max_steps_in_flight == MAX_STEPS_IN_FLIGHT >= 2 * capacity.max_steps_per_command >= 4

    async def both() -> list[scheduler_pb2.StepResult]:
        # Both steps are handed over before either is answered, each awaited in its own task in the
        # order received, as the Attach client does.
        first = runtime.run_step(scheduler_pb2.RunStep(step_id=1, seqs=[seq_step(1, b"abc", 0, (0,), reset=True)]))
        second = runtime.run_step(scheduler_pb2.RunStep(step_id=2, seqs=[scheduler_pb2.SequenceStep(
            seq_id=1, start_position=3, sample=True, num_generated=1, input_from_last_sample=True,
            sampling=common_pb2.SamplingParams())]))
        tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(sleep.pending) == 1, "the second step's time starts when the first one's ends"
        sleep.pending[0].set_result(None)
        for _ in range(5):
            await asyncio.sleep(0)
        assert tasks[0].done() and not tasks[1].done() and len(sleep.pending) == 2
        sleep.pending[1].set_result(None)
        return list(await asyncio.gather(*tasks))

    results = asyncio.run(both())
    assert [r.outputs[0].token_id for r in results] == mock_continuation(b"abc", 2)
    assert sleep.delays_s == [0.005, 0.005]


class _StepsThenEOF:
    """An Attach call: reads two RunSteps, then EOF once both results are written; each write
    completes only when the test lets it."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.gates: list[asyncio.Future[None]] = []
        self._commands = [scheduler_pb2.SchedulerCommand(run_step=scheduler_pb2.RunStep(step_id=i)) for i in (1, 2)]

    async def read(self):
        if self._commands:
            return self._commands.pop(0)
        while len(self.events) < 4 or not all(g.done() for g in self.gates):
            await asyncio.sleep(0)
        return grpc.aio.EOF

    async def write(self, message) -> None:
        step_id = message.step_result.step_id
        self.events.append(f"write {step_id}")
        gate = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        await gate
        self.events.append(f"written {step_id}")


class _RecordingRuntime(FakeStepRuntime):
    def __init__(self, call: _StepsThenEOF) -> None:
        self._call = call

    def run_step(self, command):
        self._call.events.append(f"run {command.step_id}")
        return scheduler_pb2.StepResult(step_id=command.step_id)


def test_a_step_sent_ahead_runs_once_the_last_result_is_written():
    call = _StepsThenEOF()
    client = AttachClient("127.0.0.1:1", _RecordingRuntime(call), "w", Backoff(0.1, 1.0))

    async def session() -> None:
        reading = asyncio.ensure_future(client._read_commands(call))
        for _ in range(20):
            await asyncio.sleep(0)
        # Step 2 arrived during step 1, but its compute would hold the event loop with result 1 unsent.
        assert call.events == ["run 1", "write 1"]
        call.gates[0].set_result(None)
        for _ in range(20):
            await asyncio.sleep(0)
        assert call.events == ["run 1", "write 1", "written 1", "run 2", "write 2"]
        call.gates[1].set_result(None)
        await asyncio.wait_for(reading, timeout=5)

    asyncio.run(session())
    client.close()


class _CommandsThenEOF:
    """An Attach call that hands out the given commands, records what is written, then ends."""

    def __init__(self, commands: list[scheduler_pb2.SchedulerCommand], num_writes: int) -> None:
        self.events: list[str] = []
        self.written: list[scheduler_pb2.WorkerMessage] = []
        self._commands = commands
        self._num_writes = num_writes

    async def read(self):
        if self._commands:
            return self._commands.pop(0)
        while len(self.written) < self._num_writes:
            await asyncio.sleep(0)
        return grpc.aio.EOF

    async def write(self, message) -> None:
        self.events.append("write")
        self.written.append(message)


def test_run_steps_run_back_to_back_in_order_and_are_answered_in_one_message():
    steps = scheduler_pb2.SchedulerCommand()
    for step_id in (3, 4, 5):
        steps.run_steps.steps.add(step_id=step_id)
    after = scheduler_pb2.SchedulerCommand(run_step=scheduler_pb2.RunStep(step_id=6))
    call = _CommandsThenEOF([steps, after], num_writes=2)
    client = AttachClient("127.0.0.1:1", _RecordingRuntime(call), "w", Backoff(0.1, 1.0))  # type: ignore[arg-type]

    async def session() -> None:
        await asyncio.wait_for(client._read_commands(call), timeout=5)

    asyncio.run(session())
    client.close()
    assert call.events == ["run 3", "run 4", "run 5", "write", "run 6", "write"]
    together, alone = call.written
    assert [r.step_id for r in together.step_results.results] == [3, 4, 5]
    assert alone.WhichOneof("kind") == "step_result" and alone.step_result.step_id == 6
