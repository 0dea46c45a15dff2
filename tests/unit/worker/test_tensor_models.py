"""`kind: tensor`: TorchScript and ONNX files imported, loaded, golden-checked and run in batches.

The models are made and exported here (tests/support/tensor_models.py). Where a batch holds the
same rows as a direct call, outputs are compared bit for bit; across different batch compositions
(a row computed alone vs stacked with others) within 1e-6 absolute, as BLAS blocking may round
a row differently.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from services.worker.models.tensor_model import OnnxModel, TorchScriptModel
from services.worker.repository.errors import ChecksumMismatch, GoldenCheckFailed, IncompatibleWeights
from services.worker.repository.golden import run_golden_check
from services.worker.repository.loader import LoadedModel, load_model
from services.worker.tensor_executor import TensorExecutor
from services.worker.tensor_work import TensorItem, WireTensor
from services.worker.work import ErrorCode
from tests.support.tensor_models import CNN, MODELS, SEQ, import_model, install_unloadable

FORMATS = ("torchscript", "onnx")


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exports, root = tmp_path_factory.mktemp("exports"), tmp_path_factory.mktemp("repo")
    for model in MODELS:
        for fmt in FORMATS:
            import_model(model, fmt, exports, root)
    return root


def loaded(repository: Path, model_name: str, fmt: str) -> LoadedModel:
    return load_model(repository, f"{model_name}-{fmt}", "1", num_threads=1)


def wire(name: str, array: np.ndarray, datatype: str) -> WireTensor:
    return WireTensor(name, datatype, tuple(array.shape), np.ascontiguousarray(array).tobytes())


def item(item_id: int, **arrays: np.ndarray) -> TensorItem:
    types = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    return TensorItem(item_id, tuple(wire(n, a, types[a.dtype]) for n, a in arrays.items()))


def output(result, name: str) -> np.ndarray:
    tensor = next(t for t in result.outputs if t.name == name)
    dtype = {"FP32": np.float32, "INT64": np.int64}[tensor.datatype]
    return np.frombuffer(tensor.data, dtype).reshape(tensor.shape)


class SpyModel:
    """The real runtime, recording the shapes of every batch it is given."""

    def __init__(self, model) -> None:
        self.model, self.device, self.feeds = model, model.device, []

    def run(self, inputs):
        self.feeds.append({k: v.shape for k, v in inputs.items()})
        return self.model.run(inputs)


# --- load --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_imported_version_loads_and_passes_its_golden_check(repository, model, fmt):
    m = loaded(repository, model.name, fmt)
    assert isinstance(m.tensor, TorchScriptModel if fmt == "torchscript" else OnnxModel)
    run_golden_check(m)  # raises on any mismatch
    assert len(m.manifest.tensor.golden) == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_model_file_is_kept_unchanged_and_pinned_by_sha256(repository, tmp_path, fmt):
    directory = repository / f"seq-{fmt}" / "1"
    manifest = json.loads((directory / "manifest.json").read_text())
    model_file = directory / manifest["weights"]["file"]
    assert hashlib.sha256(model_file.read_bytes()).hexdigest() == manifest["weights"]["sha256"]
    assert manifest["tensor"]["format"] == fmt


def test_a_modified_model_file_is_refused_before_it_is_opened(repository, tmp_path):
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(repository / "cnn-onnx", root / "cnn-onnx")
    model_file = next((root / "cnn-onnx" / "1").glob("*.onnx"))
    model_file.write_bytes(model_file.read_bytes() + b"\0")
    with pytest.raises(ChecksumMismatch, match="sha256"):
        load_model(root, "cnn-onnx", "1")


def test_golden_outputs_that_disagree_fail_the_check(repository, tmp_path):
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(repository / "mlp-onnx", root / "mlp-onnx")
    path = root / "mlp-onnx" / "1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tensor"]["golden_tolerance"] = {"atol": 0.0, "rtol": 0.0}
    out = manifest["tensor"]["golden"][0]["outputs"][0]
    data = bytearray(__import__("base64").b64decode(out["data_b64"]))
    data[0:4] = np.float32(123.0).tobytes()
    out["data_b64"] = __import__("base64").b64encode(bytes(data)).decode()
    path.write_text(json.dumps(manifest))
    with pytest.raises(GoldenCheckFailed, match="golden case 0 output 'y'"):
        run_golden_check(load_model(root, "mlp-onnx", "1"))


@pytest.mark.parametrize(("op", "domain"), [("FrobnicateV2", ""), ("Frobnicate", "com.example")])
def test_an_onnx_op_the_runtime_lacks_is_refused_at_load_naming_the_op(repository, tmp_path, op, domain):
    install_unloadable(tmp_path / "repo", "bad", repository / "cnn-onnx" / "1" / "manifest.json", op, domain)
    with pytest.raises(IncompatibleWeights, match=f"cannot run op '{domain + ':' if domain else ''}{op}'"):
        load_model(tmp_path / "repo", "bad", "1")


def test_an_onnx_graph_that_does_not_match_the_manifest_is_refused(repository, tmp_path):
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(repository / "mlp-onnx", root / "mlp-onnx")
    path = root / "mlp-onnx" / "1" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tensor"]["inputs"][1]["name"] = "bias"  # the graph calls it 'b'
    for case in manifest["tensor"]["golden"]:
        case["inputs"][1]["name"] = "bias"
    path.write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleWeights, match=r"the graph's inputs are \['a', 'b'\], the manifest declares \['a', 'bias'\]"):
        load_model(root, "mlp-onnx", "1")


# --- batches -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_requests_of_one_shape_are_stacked_and_each_gets_its_own_rows(repository, fmt):
    m = loaded(repository, "mlp", fmt)
    spy = SpyModel(m.tensor)
    executor = TensorExecutor(spy, m.manifest.tensor, max_batch_size=8)
    rng = np.random.default_rng(0)
    sizes = (1, 3, 1, 2)
    inputs = [(rng.standard_normal((n, 4), np.float32), rng.standard_normal((n, 3), np.float32)) for n in sizes]
    results, _ = executor.execute([item(i, a=a, b=b) for i, (a, b) in enumerate(inputs)])
    assert spy.feeds == [{"a": (7, 4), "b": (7, 3)}]
    stacked = m.tensor.run({"a": np.concatenate([a for a, _ in inputs]), "b": np.concatenate([b for _, b in inputs])})
    start = 0
    for (a, b), result, n in zip(inputs, results, sizes, strict=True):
        assert result.error is None
        assert np.array_equal(output(result, "y"), stacked["y"][start:start + n])  # the same batch: bit for bit
        alone = m.tensor.run({"a": a, "b": b})
        np.testing.assert_allclose(output(result, "norm"), alone["norm"], rtol=0, atol=1e-6)
        start += n


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_sequence_lengths_in_one_batch_are_never_stacked_together(repository, fmt):
    m = loaded(repository, "seq", fmt)
    spy = SpyModel(m.tensor)
    executor = TensorExecutor(spy, m.manifest.tensor, max_batch_size=8)
    rng = np.random.default_rng(1)
    token_batches = [rng.integers(0, 16, (1, length), dtype=np.int64) for length in (3, 5, 3, 7, 5, 3)]
    results, _ = executor.execute([item(i, tokens=t) for i, t in enumerate(token_batches)])
    assert spy.feeds == [{"tokens": (3, 3)}, {"tokens": (2, 5)}, {"tokens": (1, 7)}]
    for tokens, result in zip(token_batches, results, strict=True):
        assert output(result, "logits").shape == (1, tokens.shape[1], 5)
        alone = m.tensor.run({"tokens": tokens})
        np.testing.assert_allclose(output(result, "pooled"), alone["pooled"], rtol=0, atol=1e-6)


def test_a_group_larger_than_max_batch_size_runs_in_several_batches(repository):
    m = loaded(repository, "cnn", "onnx")
    spy = SpyModel(m.tensor)
    executor = TensorExecutor(spy, m.manifest.tensor, max_batch_size=4)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((n, 1, 8, 8), np.float32) for n in (3, 2, 1, 4)]
    results, _ = executor.execute([item(i, x=x) for i, x in enumerate(xs)])
    assert [f["x"][0] for f in spy.feeds] == [3, 3, 4]  # [3], [2, 1], [4]: an item is never split
    assert all(r.error is None for r in results)
    np.testing.assert_allclose(output(results[3], "probs").sum(axis=1), np.ones(4), rtol=1e-5)


def _f32(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


@pytest.mark.parametrize(("arrays", "message"), [
    ({"a": np.zeros((1, 4), np.float64), "b": _f32(1, 3)}, "input 'a' must be FP32, got FP64"),
    ({"a": _f32(1, 5), "b": _f32(1, 3)}, "input 'a' must have shape [-1, 4] (-1: any size >= 1), got [1, 5]"),
    ({"b": _f32(1, 3)}, "missing input(s) ['a']"),
    ({"a": _f32(1, 4), "b": _f32(1, 3), "c": _f32(1, 2)}, "unexpected input(s) ['c']"),
    ({"a": _f32(9, 4), "b": _f32(9, 3)}, "input 'a' has a batch of 9; the model takes at most 8"),
    ({"a": _f32(2, 4), "b": _f32(1, 3)}, "inputs must share one batch size"),
], ids=["datatype", "shape", "missing", "extra", "batch-over-max", "ragged-batch"])
def test_a_bad_item_fails_alone_naming_the_input_and_the_rest_run(repository, arrays, message):
    m = loaded(repository, "mlp", "onnx")
    executor = TensorExecutor(m.tensor, m.manifest.tensor, max_batch_size=8)
    rng = np.random.default_rng(3)
    good = item(0, a=rng.standard_normal((2, 4), np.float32), b=rng.standard_normal((2, 3), np.float32))
    datatype = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64"}
    bad = TensorItem(1, tuple(wire(n, a, datatype[a.dtype]) for n, a in arrays.items()))
    results, _ = executor.execute([good, bad, good])
    assert results[1].error is not None and results[1].error.code is ErrorCode.INVALID_ARGUMENT
    assert message in results[1].error.message
    assert results[0].error is None and results[2].error is None
    assert np.array_equal(output(results[0], "y"), output(results[2], "y"))


def test_a_wrong_number_of_bytes_for_the_shape_is_refused_naming_the_input(repository):
    m = loaded(repository, "cnn", "torchscript")
    executor = TensorExecutor(m.tensor, m.manifest.tensor, max_batch_size=8)
    short = TensorItem(0, (WireTensor("x", "FP32", (1, 1, 8, 8), b"\0" * 255),))
    [result], _ = executor.execute([short])
    assert result.error.message == "input 'x' of shape [1, 1, 8, 8] FP32 needs 256 bytes, got 255"


def test_torchscript_and_onnx_exports_of_one_network_agree(repository):
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, 16, (3, 6), dtype=np.int64)
    ts = loaded(repository, SEQ.name, "torchscript").tensor.run({"tokens": tokens})
    ox = loaded(repository, SEQ.name, "onnx").tensor.run({"tokens": tokens})
    for name in ("pooled", "logits"):
        np.testing.assert_allclose(ts[name], ox[name], rtol=1e-5, atol=1e-6)
    x = rng.standard_normal((2, 1, 8, 8), np.float32)
    np.testing.assert_allclose(loaded(repository, CNN.name, "torchscript").tensor.run({"x": x})["probs"],
                               loaded(repository, CNN.name, "onnx").tensor.run({"x": x})["probs"], atol=1e-6)
