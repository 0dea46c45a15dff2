"""The generator models the scheduler's reliability tests run against, with what each must stream.

The toy generator (a letter followed by the next one) and the mock generator (tokens a fixed
function of seed, position and last token, waiting on a timer) are both deterministic, so a
test knows the exact text every stream must carry, however its sequences were preempted,
recomputed or moved to another worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.worker.mock_models import mock_continuation
from tools.testbed.scheduler_fixtures import tenant, toy_continuation


@dataclass(frozen=True)
class GeneratorModel:
    ref: common_pb2.ModelRef
    step_args: Callable[[float], tuple[str, ...]]  # worker flags for a step of this many milliseconds
    continuation: Callable[[str, int], str]  # greedy output after a prompt

    @property
    def name(self) -> str:
        return self.ref.name

    def worker_args(self, step_ms: float, *extra: str) -> tuple[str, ...]:
        return (*self.step_args(step_ms), *extra)

    def request(self, prompt: str, max_tokens: int, who: str = "tests") -> scheduler_pb2.ScheduleGenerateRequest:
        return scheduler_pb2.ScheduleGenerateRequest(
            request=gateway_pb2.GenerateRequest(
                model=self.ref, prompt=prompt, sampling=common_pb2.SamplingParams(max_tokens=max_tokens)
            ),
            tenant=tenant(who),
        )


def mock_text(prompt: str, num_tokens: int, seed: int = 0) -> str:
    return bytes(mock_continuation(prompt.encode(), num_tokens, seed)).decode()


TOY = GeneratorModel(common_pb2.ModelRef(name="toy-generator"),
                     lambda step_ms: ("--toy-compute-ms", f"{step_ms:g}"), toy_continuation)
# block_size 16 and max_seq_len 512, like the toy generator, so the tests' block arithmetic holds.
MOCK = GeneratorModel(common_pb2.ModelRef(name="mock-generator"),
                      lambda step_ms: ("--mock-profile", f"step_ms={step_ms:g},block_size=16,max_seq_len=512"),
                      mock_text)
GENERATOR_MODELS = {model.name: model for model in (TOY, MOCK)}
