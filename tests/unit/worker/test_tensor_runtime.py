"""TensorRuntime: the Attach seam of a tensor model (hello, warm-up + golden check, ExecuteBatch <-> tensors)."""

from __future__ import annotations

import numpy as np
import pytest

from infermesh.v1 import common_pb2, scheduler_pb2
from services.worker.repository.loader import load_model
from services.worker.repository.tensor_import import ImageFlags, ImportRequest, import_tensor_model
from services.worker.runtime import BatchRuntime
from services.worker.tensor_runtime import TensorRuntime
from tests.support.tensor_models import CNN, SEQ, export_onnx, import_model


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    exports, root = tmp_path_factory.mktemp("exports"), tmp_path_factory.mktemp("repo")
    import_model(SEQ, "onnx", exports, root, max_batch_size=4)
    import_tensor_model(ImportRequest(export_onnx(CNN, exports), "cnn-image", "1", root,
                                      image=ImageFlags("x", (0.5,), (0.25,), 64 * 64)))
    return root


def runtime(repository, name: str, max_batch_size: int = 4) -> TensorRuntime:
    served = TensorRuntime(load_model(repository, name, "1"), max_batch_size)
    served.load()  # warm-up at the full batch and the golden check
    return served


def tensor(name: str, array: np.ndarray, datatype: str) -> common_pb2.Tensor:
    return common_pb2.Tensor(name=name, datatype=datatype, shape=list(array.shape), data=array.tobytes())


def test_hello_declares_a_tensor_model_with_its_wire_signature(repository):
    served = runtime(repository, "cnn-image")
    assert isinstance(served, BatchRuntime)
    hello = served.hello("w-1")
    assert hello.kind == common_pb2.MODEL_KIND_TENSOR and hello.capacity.max_batch_size == 4
    assert [(t.name, t.datatype, list(t.dims)) for t in hello.tensor_inputs] == [("x", "UINT8", [-1, -1, -1, 1])]
    assert [(t.name, t.datatype, list(t.dims)) for t in hello.tensor_outputs] == [("probs", "FP32", [-1, 10])]
    assert hello.capacity.warm_batch_time_us > 0  # the warm-up's second run, measured at load


def test_execute_batch_answers_each_item_with_its_outputs_or_its_error(repository):
    served = runtime(repository, "seq-onnx")
    rng = np.random.default_rng(0)
    short, long = rng.integers(0, 16, (1, 3)), rng.integers(0, 16, (2, 6))
    command = scheduler_pb2.ExecuteBatch(batch_id=7, items=[
        scheduler_pb2.BatchItem(item_id=1, inputs=[tensor("tokens", short, "INT64")]),
        scheduler_pb2.BatchItem(item_id=2, inputs=[tensor("tokens", long.astype(np.int32), "INT32")]),
        scheduler_pb2.BatchItem(item_id=3, image=common_pb2.Image(encoded=b"png")),
        scheduler_pb2.BatchItem(item_id=4, inputs=[tensor("tokens", long, "INT64")]),
    ])
    result = served.execute_batch(command)
    by_id = {item.item_id: item for item in result.items}
    assert result.batch_id == 7 and sorted(by_id) == [1, 2, 3, 4]
    assert "input 'tokens' must be INT64, got INT32" in by_id[2].error.message
    assert "send `inputs`, not an image" in by_id[3].error.message
    pooled = {t.name: t for t in by_id[4].outputs}["pooled"]
    assert (pooled.datatype, list(pooled.shape)) == ("FP32", [2, 8])
    want = load_model(repository, "seq-onnx", "1").tensor.run({"tokens": long})["pooled"]
    np.testing.assert_allclose(np.frombuffer(pooled.data, np.float32).reshape(2, 8), want, rtol=0, atol=1e-6)
    assert by_id[1].error.code == 0 and [t.name for t in by_id[1].outputs] == ["pooled", "logits"]


def test_uint8_images_of_any_size_reach_an_image_input_through_the_kernel(repository):
    served = runtime(repository, "cnn-image")
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (1, h, w, 1), dtype=np.uint8) for h, w in ((8, 8), (31, 17))]
    result = served.execute_batch(scheduler_pb2.ExecuteBatch(batch_id=1, items=[
        scheduler_pb2.BatchItem(item_id=i, inputs=[tensor("x", im, "UINT8")]) for i, im in enumerate(images)]))
    for item in result.items:
        probs = np.frombuffer(item.outputs[0].data, np.float32)
        assert item.error.code == 0 and probs.shape == (10,) and abs(probs.sum() - 1) < 1e-5
