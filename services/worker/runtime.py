"""The seam between the Attach stream and a model: commands in, results out (protobuf).

A runtime is where protobuf meets the model's domain objects; the attach client
only moves messages. What a runtime offers depends on how its model computes:

- a BatchRuntime (classifiers; fixed-shape models) answers whole batches, each item on its own;
- a StepRuntime (generators) runs steps over sequences whose KV blocks it holds between
  steps, so it also forgets sequences (abort, forget_all) and counts the blocks in use.

Both say hello and load (ModelRuntime). A command of the other kind never reaches a runtime:
the attach client answers it with an error per item or sequence.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from infermesh.v1 import scheduler_pb2
from services.common.clock import Clock
from services.common.timings import seconds_to_us


class ModelRuntime(Protocol):
    def load(self) -> None:
        """Load weights (checksum), warm up, pass the golden check; raise if not servable."""

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello: ...


# A runtime may return an awaitable of its result instead (one that waits on a timer or a device,
# not the CPU): the attach client awaits it on its event loop.


@runtime_checkable
class BatchRuntime(ModelRuntime, Protocol):
    def execute_batch(
        self, command: scheduler_pb2.ExecuteBatch
    ) -> scheduler_pb2.BatchResult | Awaitable[scheduler_pb2.BatchResult]: ...


@runtime_checkable
class StepRuntime(ModelRuntime, Protocol):
    def run_step(
        self, command: scheduler_pb2.RunStep
    ) -> scheduler_pb2.StepResult | Awaitable[scheduler_pb2.StepResult]: ...

    def abort(self, command: scheduler_pb2.Abort) -> None: ...

    def forget_all(self) -> None:
        """The Attach session ended: forget every sequence's block table. A scheduler re-dialled (or
        another one) recomputes what it still wants from scratch, so none of them is used again."""

    def kv_blocks_used(self) -> int: ...


@runtime_checkable
class SendsTokenizerFile(Protocol):
    def tokenizer_file(self) -> bytes:
        """The bytes that follow a TOKENIZER_KIND_HF hello (tokenizer.json); b"" when none follow."""
        ...


WorkerRuntime = BatchRuntime | StepRuntime


def warm_batch_time_us(run_batch: Callable[[], object], clock: Clock = time.perf_counter) -> int:
    """Runs a warm-up batch twice; the second run's time, microseconds (>= 1: 0 would read as unknown).
    The first pays what a batch pays once (compilation, allocator growth, lazy initialization), which
    the scheduler should not take for the model's batch time."""
    run_batch()
    began_s = clock()
    run_batch()
    return max(1, seconds_to_us(clock() - began_s))
