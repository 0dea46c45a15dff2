"""The Attach runtime of a tensor model (a BatchRuntime): ExecuteBatch items' tensors -> the executor.

Loading is the readiness gate as for classifiers: checksum (load_model), a warm-up at the full
batch from the golden inputs (run twice; the second run's time is declared as
WorkerCapacity.warm_batch_time_us), then the golden check.
"""

from __future__ import annotations

import itertools

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.protocol import ATTACH_PROTOCOL_VERSION as PROTOCOL_VERSION
from services.common.timings import StageTime, seconds_to_us, to_proto
from services.worker.repository.golden import run_golden_check
from services.worker.repository.loader import LoadedModel
from services.worker.repository.tensor_spec import TensorIO, TensorSpec
from services.worker.runtime import warm_batch_time_us
from services.worker.step_codec import item_error_to_proto
from services.worker.tensor_executor import TensorExecutor
from services.worker.tensor_work import TensorItem, WireTensor
from services.worker.work import ErrorCode, ItemError, StageDurations

SERVICE = "worker"


class TensorRuntime:
    def __init__(self, model: LoadedModel, max_batch_size: int) -> None:
        self._model = model
        self._max_batch_size = max_batch_size
        self._executor = TensorExecutor(model.tensor, self._spec, max_batch_size)
        self._warm_batch_time_us = 0  # measured by load()

    @property
    def _spec(self) -> TensorSpec:
        spec = self._model.manifest.tensor
        assert spec is not None  # built for a tensor manifest (SERVING_RUNTIMES)
        return spec

    def load(self) -> None:
        """Warm-up: the golden cases' rows repeated up to a full batch, then the golden check."""
        spec = self._spec
        wire = {io.name: io.wire_datatype for io in spec.inputs}
        warm: list[TensorItem] = []
        rows = 0
        for case in itertools.cycle(spec.golden):
            if rows + case.inputs[0].shape[0] > self._max_batch_size:
                break
            warm.append(TensorItem(len(warm), tuple(WireTensor(t.name, wire[t.name], t.shape, t.data)
                                                    for t in case.inputs)))
            rows += case.inputs[0].shape[0]
        self._warm_batch_time_us = warm_batch_time_us(lambda: self._executor.execute(warm))
        run_golden_check(self._model)

    def hello(self, worker_id: str) -> scheduler_pb2.WorkerHello:
        manifest = self._model.manifest
        spec = self._spec
        return scheduler_pb2.WorkerHello(
            worker_id=worker_id,
            model=common_pb2.ModelRef(name=manifest.name, version=manifest.version),
            kind=common_pb2.MODEL_KIND_TENSOR,
            capacity=scheduler_pb2.WorkerCapacity(
                max_batch_size=self._max_batch_size, memory_bytes=manifest.envelope.memory_bytes,
                device=self._model.device, warm_batch_time_us=self._warm_batch_time_us,
            ),
            tensor_inputs=[tensor_metadata(io) for io in spec.inputs],
            tensor_outputs=[tensor_metadata(io) for io in spec.outputs],
            preferred_batch_sizes=[s for s in spec.preferred_batch_sizes if s <= self._max_batch_size],
            protocol_version=PROTOCOL_VERSION,
        )

    def execute_batch(self, command: scheduler_pb2.ExecuteBatch) -> scheduler_pb2.BatchResult:
        items: list[TensorItem] = []
        refused: dict[int, ItemError] = {}
        for item in command.items:
            if item.HasField("image"):
                refused[item.item_id] = ItemError(ErrorCode.INVALID_ARGUMENT,
                                                  "this is a tensor model: send `inputs`, not an image")
            else:
                items.append(TensorItem(item.item_id, tuple(
                    WireTensor(t.name, t.datatype, tuple(t.shape), t.data) for t in item.inputs)))
        results, durations = self._executor.execute(items)
        result = scheduler_pb2.BatchResult(batch_id=command.batch_id, timings=_timings(durations))
        add = result.items.add
        for r in results:
            add(item_id=r.item_id, error=item_error_to_proto(r.error),
                outputs=[common_pb2.Tensor(name=t.name, datatype=t.datatype, shape=t.shape, data=t.data)
                         for t in r.outputs])
        for item_id, error in refused.items():
            add(item_id=item_id, error=item_error_to_proto(error))
        return result


def tensor_metadata(io: TensorIO) -> common_pb2.TensorMetadata:
    return common_pb2.TensorMetadata(name=io.name, datatype=io.wire_datatype, dims=io.wire_dims, labels=io.labels)


def _timings(durations: StageDurations) -> common_pb2.Timings:
    stages = [StageTime("decode", seconds_to_us(durations.decode_s), SERVICE),
              StageTime("compute", seconds_to_us(durations.compute_s), SERVICE),
              StageTime("postprocess", seconds_to_us(durations.postprocess_s), SERVICE)]
    return to_proto(stages, total_us=sum(s.duration_us for s in stages))
