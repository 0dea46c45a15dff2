"""A step runtime that does nothing, for attach-client tests to override the one method they watch."""

from __future__ import annotations

from infermesh.v1 import scheduler_pb2


class FakeStepRuntime:
    """Satisfies services.worker.runtime.StepRuntime: holds no sequences, answers empty steps."""

    def load(self) -> None:
        return None

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        return scheduler_pb2.WorkerHello(worker_id=worker_id)

    def run_step(self, command: scheduler_pb2.RunStep) -> scheduler_pb2.StepResult:
        return scheduler_pb2.StepResult(step_id=command.step_id)

    def abort(self, command: scheduler_pb2.Abort) -> None:
        return None

    def forget_all(self) -> None:
        return None

    def kv_blocks_used(self) -> int:
        return 0
