"""Worker metrics from results: items by outcome, the model's state."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client import REGISTRY

from infermesh.v1 import scheduler_pb2
from services.worker import metrics
from services.worker.attach_client import AttachClient, Backoff
from services.worker.expired_items import DEADLINE_EXCEEDED

from .fake_runtimes import FakeStepRuntime


def _value(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_batch_items_are_counted_by_outcome():
    model = "metrics-test-classifier"
    result = scheduler_pb2.BatchResult(items=[
        scheduler_pb2.ItemResult(), scheduler_pb2.ItemResult(),
        scheduler_pb2.ItemResult(error=scheduler_pb2.ItemError(code=DEADLINE_EXCEEDED)),
        scheduler_pb2.ItemResult(error=scheduler_pb2.ItemError(code=13)),
    ])
    metrics.observe_batch(model, result)
    assert _value("infermesh_worker_items_total", model=model, kind="classify", outcome="ok") == 2
    assert _value("infermesh_worker_items_total", model=model, kind="classify", outcome="expired") == 1
    assert _value("infermesh_worker_items_total", model=model, kind="classify", outcome="failed") == 1
    # The batch the runtime saw: computed and failed items, not the expired one.
    assert _value("infermesh_worker_batch_size_sum", model=model, kind="classify") == 3


def test_model_state_is_one_state_at_a_time_and_ready_follows_it():
    model, version = "metrics-test-model", "7"
    for state in metrics.MODEL_STATES:
        metrics.set_model_state(model, version, state)
        values = {s: _value("infermesh_worker_model_state", model=model, version=version, state=s)
                  for s in metrics.MODEL_STATES}
        assert values == {s: (1.0 if s == state else 0.0) for s in metrics.MODEL_STATES}
        assert _value("infermesh_worker_ready", model=model, version=version) == (1.0 if state == "ready" else 0.0)


def test_kv_blocks_used_falls_when_sequences_are_aborted_without_waiting_for_a_step():
    # Cancelled streams freed their blocks, but the gauge only moved at the next step, which an idle
    # worker may not run for a long time (robustness probe: 166 blocks shown with none in use).
    class Runtime(FakeStepRuntime):
        blocks = 166

        def abort(self, command) -> None:
            self.blocks = 0

        def kv_blocks_used(self) -> int:
            return self.blocks

    class AbortThenEOF:
        def __init__(self) -> None:
            self._commands = [scheduler_pb2.SchedulerCommand(abort=scheduler_pb2.Abort(seq_ids=[1, 2]))]

        async def read(self):
            return self._commands.pop(0) if self._commands else grpc.aio.EOF

    model = "metrics-test-generator"
    metrics.observe_kv_blocks(model, 166)
    client = AttachClient("127.0.0.1:1", Runtime(), "w", Backoff(0.1, 1.0))
    client._model_label = model  # as the hello of an attached session sets it
    asyncio.run(asyncio.wait_for(client._read_commands(AbortThenEOF()), timeout=5))  # type: ignore[arg-type]
    client.close()
    assert _value("infermesh_worker_kv_blocks_used", model=model) == 0
