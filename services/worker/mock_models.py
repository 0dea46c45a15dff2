"""Mock models for scale tests and benchmarks: the real Attach protocol, no model compute.

Like Dynamo's "mocker" and llm-d's inference simulator, a mock worker declares a
realistic capacity (KV blocks, block size, max sequences, step token budget), keeps
the same block-table mirror as a real generator (services/worker/sequence_mirror.py,
so it accepts and refuses exactly the same steps), and answers each step after a
configured step time spent on an asyncio timer, not the CPU. The scheduler's own
limits can then be measured with hundreds of sequences and several workers on two
cores. Never served in the demo: its tokens are not a model's.

mock-generator: byte tokenizer; every sampled token is `mock_token(seed, position,
    last token)`, a letter 'a'..'z', with seed 0 for greedy requests and the request's
    seed otherwise. Outputs are therefore reproducible across preemption, failover and
    workers, and checkable by tests. Never EOS: max_tokens ends a stream.
mock-classifier: each item's label is a hash of its image bytes (no decode).

Step time = step_ms + per_token_us x tokens computed in the step (prefill chunks cost
more than decode steps); batch time = batch_ms + per_item_us x items.

Deliberately bad versions (rollout tests, docs/operations.md "Rollouts"):
  label_shift=N  mock-classifier: every label is N classes off (wrong answers at the same speed),
                 except for the load's golden check input: a corruption the golden check misses,
                 which is what shadow comparison is for
  fail_every=N   mock-classifier: every Nth item fails with INTERNAL (N=20: 5 %)
  token_shift=N  mock-generator: every sampled letter N letters on ('a' + 1 -> 'b'), except at the
                 positions the load's golden check samples (up to GOLDEN_POSITIONS): other greedy
                 tokens at the same speed
A slower version is batch_ms / per_item_us (step_ms / per_token_us).
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.logprobs import PositionLogprobs, TokenLogprob
from services.common.timings import StageTime, seconds_to_us, to_proto
from services.worker.builtin_models import (
    BYTE_EOS,
    BYTE_VOCAB_SIZE,
    NO_IMAGE_DATA,
    PROTOCOL_VERSION,
    item_error,
)
from services.worker.sequence_mirror import MAX_STEPS_IN_FLIGHT, MAX_STEPS_PER_COMMAND, SequenceMirror
from services.worker.step_codec import run_step_from_proto, step_result_to_proto
from services.worker.work import ErrorCode, RunStep, SequenceOutput, SequenceStep

Sleep = Callable[[float], Awaitable[None]]
_MASK_64 = (1 << 64) - 1
MOCK_LABELS = tuple(f"class-{i}" for i in range(10))
_GOLDEN_PROMPT = tuple(b"abc")
# The positions the generator's load check samples at (its prompt's length): token_shift spares them.
GOLDEN_POSITIONS = len(_GOLDEN_PROMPT)


@dataclass(frozen=True)
class MockProfile:
    """Capacity the mock declares in its hello, and the time it takes. Defaults: a mid-size GPU model."""

    step_ms: float = 10.0  # fixed cost of a generate step
    per_token_us: float = 0.0  # plus this per token the step computes
    num_kv_blocks: int = 4096
    block_size: int = 16  # positions per KV block
    max_num_seqs: int = 256  # sequences per step
    max_num_batched_tokens: int = 2048  # tokens per step
    max_seq_len: int = 4096  # prompt + output positions
    batch_ms: float = 5.0  # fixed cost of a classify batch
    per_item_us: float = 0.0  # plus this per item
    max_batch_size: int = 32  # items per classify batch
    label_shift: int = 0  # classify: labels this many classes off (a bad version; 0: right)
    fail_every: int = 0  # classify: every Nth item fails with INTERNAL (a bad version; 0: none)
    token_shift: int = 0  # generate: sampled letters this many letters on (a bad version; 0: right)

    def __post_init__(self) -> None:
        for name in ("step_ms", "per_token_us", "batch_ms", "per_item_us"):
            if getattr(self, name) < 0:
                raise ValueError(f"mock profile: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("label_shift", "fail_every", "token_shift"):
            if getattr(self, name) < 0:
                raise ValueError(f"mock profile: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_seq_len",
                     "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"mock profile: {name} must be >= 1, got {getattr(self, name)}")

    def step_time_s(self, num_tokens: int) -> float:
        return (self.step_ms * 1e3 + self.per_token_us * num_tokens) / 1e6

    def batch_time_s(self, num_items: int) -> float:
        return (self.batch_ms * 1e3 + self.per_item_us * num_items) / 1e6


def parse_mock_profile(text: str) -> MockProfile:
    """'step_ms=5,per_token_us=20,num_kv_blocks=512' -> MockProfile; unnamed fields keep their defaults."""
    types = {f.name: f.type for f in dataclasses.fields(MockProfile)}
    values: dict[str, Any] = {}  # field name -> a value of that field's type (int or float)
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, raw = part.partition("=")
        name = name.strip()
        if not sep or name not in types:
            raise ValueError(f"mock profile: expected name=value with a name among {', '.join(types)}, got {part!r}")
        try:
            values[name] = int(raw) if types[name] == "int" else float(raw)
        except ValueError:
            raise ValueError(f"mock profile: {name}={raw!r} is not {'an integer' if types[name] == 'int' else 'a number'}") from None
    return MockProfile(**values)


def mock_token(seed: int, position: int, last_token: int) -> int:
    """The mock generator's token at `position` after `last_token`: a letter 'a'..'z' (splitmix64 finaliser)."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + last_token) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return ord("a") + (x ^ (x >> 31)) % 26


def mock_continuation(prompt_ids: tuple[int, ...] | list[int], num_tokens: int, seed: int = 0) -> list[int]:
    """What the mock generator streams after a prompt (greedy: seed 0)."""
    ids, out = list(prompt_ids), []
    for _ in range(num_tokens):
        token = mock_token(seed, len(ids), ids[-1])
        ids.append(token)
        out.append(token)
    return out


def _timings(elapsed_s: float) -> common_pb2.Timings:
    elapsed_us = seconds_to_us(elapsed_s)
    return to_proto([StageTime("compute", elapsed_us, "worker")], total_us=elapsed_us)


class MockGeneratorRuntime:
    name = "mock-generator"

    def __init__(self, version: str, profile: MockProfile, sleep: Sleep = asyncio.sleep) -> None:
        self._version = version
        self._profile = profile
        self._sleep = sleep
        self._mirror = SequenceMirror(profile.num_kv_blocks, profile.block_size, BYTE_VOCAB_SIZE, profile.max_seq_len)
        # One device: a step sent before the previous one's answer starts its step time after it (the
        # Attach client awaits each step in its own task, in the order received; the lock is FIFO).
        self._device = asyncio.Lock()

    def load(self) -> None:
        prompt = _GOLDEN_PROMPT
        golden = RunStep(0, (SequenceStep(0, prompt, 0, (0,), reset_block_table=True, sample=True),))
        (output,) = self.compute(golden)
        self._mirror.forget([0])
        if output.token_id != mock_continuation(prompt, 1)[0]:
            raise RuntimeError(f"{self.name} failed its golden check: {output}")

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        p = self._profile
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name=self.name, version=self._version),
            kind=common_pb2.MODEL_KIND_GENERATOR,
            capacity=scheduler_pb2.WorkerCapacity(
                num_kv_blocks=p.num_kv_blocks, block_size=p.block_size, max_seq_len=p.max_seq_len,
                max_num_seqs=p.max_num_seqs, max_num_batched_tokens=p.max_num_batched_tokens, device="mock",
                max_steps_in_flight=MAX_STEPS_IN_FLIGHT, max_steps_per_command=MAX_STEPS_PER_COMMAND,
            ),
            tokenizer=scheduler_pb2.TokenizerSpec(
                kind=scheduler_pb2.TOKENIZER_KIND_BYTES, vocab_size=BYTE_VOCAB_SIZE, eos_token_id=BYTE_EOS,
                bos_token_id=-1,
            ),
            protocol_version=PROTOCOL_VERSION,
        )

    def compute(self, step: RunStep) -> list[SequenceOutput]:
        """The step's outputs, in order, with the mirror updated as a real worker's would be."""
        admission = self._mirror.admit_step(step)
        outputs = dict(admission.refused)
        for admitted in admission.admitted:
            seq = admitted.step  # an input_from_last_sample step comes with that token filled in
            if seq.sample:
                seed = admitted.seed if seq.sampling.temperature > 0 else 0
                token = mock_token(seed, admitted.end_position, seq.token_ids[-1])
                if self._profile.token_shift and admitted.end_position > GOLDEN_POSITIONS:
                    token = ord("a") + (token - ord("a") + self._profile.token_shift) % 26
                self._mirror.computed(admitted, token)
                certain = TokenLogprob(token, 0.0)  # the mock's token has probability 1
                logprobs = (PositionLogprobs(certain, (certain,) if seq.sampling.top_logprobs else ())
                            if seq.sampling.logprobs else None)
                outputs[admitted.index] = SequenceOutput(seq.seq_id, token_id=token, logprob=0.0, logprobs=logprobs)
            else:
                self._mirror.computed(admitted)
                outputs[admitted.index] = SequenceOutput(seq.seq_id)
        return [outputs[i] for i in range(len(step.seqs))]

    def run_step(self, command: scheduler_pb2.RunStep) -> Awaitable[scheduler_pb2.StepResult]:
        step = run_step_from_proto(command)
        outputs = self.compute(step)
        return self._answer_after(self._profile.step_time_s(sum(len(s.token_ids) for s in step.seqs)),
                                  command.step_id, outputs)

    async def _answer_after(self, delay_s: float, step_id: int,
                            outputs: list[SequenceOutput]) -> scheduler_pb2.StepResult:
        async with self._device:  # FIFO: steps take their turns in the order they were sent
            await self._sleep(delay_s)
        return step_result_to_proto(step_id, outputs, _timings(delay_s))

    def abort(self, command: scheduler_pb2.Abort) -> None:
        self._mirror.forget(command.seq_ids)

    def forget_all(self) -> None:
        self._mirror.forget_all()

    def kv_blocks_used(self) -> int:
        return self._mirror.num_kv_blocks_used


def mock_label_index(image: common_pb2.Image) -> int:
    """The mock classifier's label for an image: a hash of its bytes, so a test can predict it."""
    data = image.raw.pixels if image.WhichOneof("data") == "raw" else image.encoded
    return zlib.crc32(data) % len(MOCK_LABELS)


_GOLDEN = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(4), height=2, width=2, channels=1))


class MockClassifierRuntime:
    name = "mock-classifier"

    def __init__(self, version: str, profile: MockProfile, sleep: Sleep = asyncio.sleep) -> None:
        self._version = version
        self._profile = profile
        self._sleep = sleep
        self._num_items = 0

    def load(self) -> None:
        golden = _GOLDEN
        (item,) = self.classify(scheduler_pb2.ExecuteBatch(items=[scheduler_pb2.BatchItem(item_id=1, image=golden)]))
        if item.labels[0].index != mock_label_index(golden):
            raise RuntimeError(f"{self.name} failed its golden check")

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name=self.name, version=self._version),
            kind=common_pb2.MODEL_KIND_CLASSIFIER,
            capacity=scheduler_pb2.WorkerCapacity(max_batch_size=self._profile.max_batch_size, device="mock"),
            labels=list(MOCK_LABELS),
            input_height=8,
            input_width=8,
            max_image_pixels=4096 * 4096,
            protocol_version=PROTOCOL_VERSION,
        )

    def classify(self, command: scheduler_pb2.ExecuteBatch) -> list[scheduler_pb2.ItemResult]:
        results = []
        for item in command.items:
            if item.image.WhichOneof("data") is None:
                results.append(item_error(item.item_id, NO_IMAGE_DATA))
                continue
            self._num_items += 1
            if self._profile.fail_every and self._num_items % self._profile.fail_every == 0:
                results.append(item_error(item.item_id, "mock-classifier: fail_every", ErrorCode.INTERNAL))
                continue
            index = mock_label_index(item.image)
            if item.image != _GOLDEN:
                index = (index + self._profile.label_shift) % len(MOCK_LABELS)
            label = common_pb2.Label(label=MOCK_LABELS[index], index=index, score=1.0)
            results.append(scheduler_pb2.ItemResult(item_id=item.item_id, labels=[label]))
        return results

    def execute_batch(self, command: scheduler_pb2.ExecuteBatch) -> Awaitable[scheduler_pb2.BatchResult]:
        return self._answer_after(self._profile.batch_time_s(len(command.items)), command.batch_id,
                                  self.classify(command))

    async def _answer_after(self, delay_s: float, batch_id: int,
                            items: list[scheduler_pb2.ItemResult]) -> scheduler_pb2.BatchResult:
        await self._sleep(delay_s)
        return scheduler_pb2.BatchResult(batch_id=batch_id, items=items, timings=_timings(delay_s))


MOCK_MODELS: dict[str, type[MockGeneratorRuntime] | type[MockClassifierRuntime]] = {
    MockGeneratorRuntime.name: MockGeneratorRuntime, MockClassifierRuntime.name: MockClassifierRuntime}


def make_mock_runtime(name: str, version: str, profile_text: str, num_kv_blocks: int = 0,
                      max_batch_size: int = 0) -> MockGeneratorRuntime | MockClassifierRuntime:
    """The worker's generic --num-kv-blocks / --max-batch-size overrides win over the profile's."""
    profile = parse_mock_profile(profile_text)
    overrides = {k: v for k, v in (("num_kv_blocks", num_kv_blocks), ("max_batch_size", max_batch_size)) if v}
    return MOCK_MODELS[name](version, dataclasses.replace(profile, **overrides))
