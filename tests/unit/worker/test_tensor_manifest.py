"""The `tensor` block's validator, and `models import` refusing what it cannot infer (naming the flag)."""

from __future__ import annotations

import base64
import copy
import json

import numpy as np
import pytest

from services.worker.repository.errors import InvalidManifest
from services.worker.repository.manifest import ModelKind, manifest_to_dict, parse_manifest
from services.worker.repository.tensor_import import (
    ImageFlags,
    ImportRefused,
    ImportRequest,
    import_tensor_model,
    parse_input_flag,
)
from services.worker.repository.tensor_spec import TensorIO
from tests.support.tensor_models import CNN, MLP, export_onnx, export_torchscript, import_model


@pytest.fixture(scope="module")
def mlp_manifest(tmp_path_factory: pytest.TempPathFactory) -> dict:
    exports, root = tmp_path_factory.mktemp("exports"), tmp_path_factory.mktemp("repo")
    directory = import_model(MLP, "onnx", exports, root)
    return json.loads((directory / "manifest.json").read_text())


def test_an_imported_manifest_round_trips(mlp_manifest):
    manifest = parse_manifest(mlp_manifest, source="m.json")
    assert manifest.kind is ModelKind.TENSOR
    assert [(io.name, io.datatype, io.dims) for io in manifest.tensor.inputs] == [
        ("a", "FP32", (-1, 4)), ("b", "FP32", (-1, 3))]
    assert manifest_to_dict(manifest) == mlp_manifest


def _broken(manifest: dict, edit) -> dict:
    data = copy.deepcopy(manifest)
    edit(data["tensor"])
    return data


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.update(format="savedmodel"), "field 'tensor.format' must be 'torchscript' or 'onnx'"),
    (lambda t: t["inputs"][0].update(datatype="BYTES"), "field 'tensor.inputs[0].datatype' must be 'BOOL' or"),
    (lambda t: t["inputs"][0].update(dims=[2, 4]), "field 'tensor.inputs[0].dims' must lead with the batch dim"),
    (lambda t: t["inputs"][0].update(dims=[-1, 0]), "field 'tensor.inputs[0].dims' must be -1 (dynamic) or >= 1"),
    (lambda t: t["outputs"][0].update(name="a"), "field 'tensor.inputs' and outputs must have distinct names"),
    (lambda t: t.update(preferred_batch_sizes=[4, 2]), "field 'tensor.preferred_batch_sizes' must be increasing"),
    (lambda t: t.update(preferred_batch_sizes=[16]), "field 'tensor.preferred_batch_sizes' must hold integers in [1, 9)"),
    (lambda t: t["golden"][0]["inputs"][0].update(data_b64="AAAA"), "field 'tensor.golden[0].inputs[0].data_b64' decodes to 3 bytes"),
    (lambda t: t["golden"][0]["inputs"].pop(), "field 'tensor.golden[0].inputs' must name each of ['a', 'b'] once"),
    (lambda t: t["golden"][0]["outputs"][0].update(shape=[1, 6]), "field 'tensor.golden[0].outputs[0].shape' [1, 6] does not fit"),
    (lambda t: t.update(golden_tolerance={"atol": -1, "rtol": 0}), "field 'tensor.golden_tolerance.atol' and rtol must be >= 0"),
    (lambda t: t["inputs"][0].update(image={"channels": 1, "mean": [0.5], "std": [0.5], "max_image_pixels": 64}),
     "field 'tensor.inputs[0].image' needs an FP32 input of dims [-1, 1, H, W]"),
    (lambda t: t["outputs"][0].update(labels=["x", "y"]), "field 'tensor.outputs[0].labels' has 2 entries"),
    (lambda t: t.update(extra=1), "unknown field(s) ['extra'] in tensor"),
])
def test_a_broken_tensor_block_is_refused_naming_the_field(mlp_manifest, edit, message):
    with pytest.raises(InvalidManifest) as refused:
        parse_manifest(_broken(mlp_manifest, edit), source="m.json")
    assert message in str(refused.value)


def test_a_tensor_manifest_must_not_carry_another_kinds_block(mlp_manifest):
    data = {**copy.deepcopy(mlp_manifest), "classifier": {}}
    with pytest.raises(InvalidManifest, match="field 'classifier' must be absent for a tensor"):
        parse_manifest(data, source="m.json")


def test_torchscript_without_inputs_is_refused_naming_the_flag(tmp_path):
    source = export_torchscript(CNN, tmp_path)
    with pytest.raises(ImportRefused, match="give each with --input NAME:DATATYPE:DIMS"):
        import_tensor_model(ImportRequest(source, "cnn", "1", tmp_path / "repo"))
    assert not (tmp_path / "repo" / "cnn").exists()


def test_torchscript_with_too_few_output_names_is_refused_naming_the_flag(tmp_path):
    source = export_torchscript(MLP, tmp_path)
    request = ImportRequest(source, "mlp", "1", tmp_path / "repo",
                            inputs=tuple(parse_input_flag(f) for f in MLP.inputs), output_names=("y",))
    with pytest.raises(ImportRefused, match="forward\\(\\) returns 2 tensors but --output names 1"):
        import_tensor_model(request)


def test_torchscript_inputs_the_model_cannot_take_are_refused_with_the_shapes_tried(tmp_path):
    source = export_torchscript(CNN, tmp_path)
    request = ImportRequest(source, "cnn", "1", tmp_path / "repo", inputs=(parse_input_flag("x:FP32:-1,3,8,8"),))
    with pytest.raises(ImportRefused, match=r"fails on example inputs \{'x': \[1, 3, 8, 8\]\}.*check the --input dims"):
        import_tensor_model(request)


def test_an_onnx_input_with_a_fixed_batch_dim_is_refused_naming_the_flag(tmp_path):
    import torch

    source = tmp_path / "fixed.onnx"
    torch.onnx.export(torch.nn.Linear(4, 2).eval(), (torch.randn(1, 4),), str(source), dynamo=False,
                      input_names=["x"], output_names=["y"])
    with pytest.raises(ImportRefused, match=r"input 'x' has a fixed batch dim \[1, 4\].*--input x:FP32:-1,"):
        import_tensor_model(ImportRequest(source, "fixed", "1", tmp_path / "repo"))


@pytest.mark.parametrize(("flag", "message"), [
    ("x:FP32", "expected NAME:DATATYPE:DIMS"),
    ("x:FLOAT:-1,4", "datatype must be one of BOOL"),
    ("x:FP32:4,4", "DIMS lead with the batch dim -1"),
    ("x:FP32:-1,a", "DIMS must be integers"),
])
def test_a_malformed_input_flag_is_refused(flag, message):
    with pytest.raises(ImportRefused, match=message):
        parse_input_flag(flag)


def test_an_existing_version_is_never_overwritten(tmp_path):
    import_model(MLP, "onnx", tmp_path, tmp_path / "repo", name="mlp")
    with pytest.raises(ImportRefused, match="a version is immutable"):
        import_model(MLP, "onnx", tmp_path, tmp_path / "repo", name="mlp")


def test_an_unknown_file_type_is_refused(tmp_path):
    source = tmp_path / "model.pb"
    source.write_bytes(b"x")
    with pytest.raises(ImportRefused, match="not a model file this import reads"):
        import_tensor_model(ImportRequest(source, "m", "1", tmp_path / "repo"))


def test_an_image_input_takes_uint8_images_of_any_size_through_the_preprocess_kernel(tmp_path):
    from services.worker.repository.loader import load_model
    from services.worker.tensor_executor import TensorExecutor
    from services.worker.tensor_work import TensorItem, WireTensor

    source = export_onnx(CNN, tmp_path)
    import_tensor_model(ImportRequest(source, "cnn-image", "1", tmp_path / "repo",
                                      image=ImageFlags("x", (0.5,), (0.25,), 64 * 64)))
    model = load_model(tmp_path / "repo", "cnn-image", "1")  # its golden cases are uint8 images
    x = model.manifest.tensor.inputs[0]
    assert (x.wire_datatype, x.wire_dims) == ("UINT8", (-1, -1, -1, 1))
    executor = TensorExecutor(model.tensor, model.manifest.tensor, max_batch_size=8)
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, (n, h, w, 1), dtype=np.uint8) for n, h, w in ((1, 8, 8), (2, 20, 13), (1, 90, 90))]
    results, _ = executor.execute([TensorItem(i, (WireTensor("x", "UINT8", im.shape, im.tobytes()),))
                                   for i, im in enumerate(images)])
    assert [r.outputs[0].shape for r in results[:2]] == [(1, 10), (2, 10)]
    assert results[2].error.message == "input 'x' images are 90x90, above the model's 4096 pixels"


def test_an_image_step_on_an_input_that_is_not_an_image_is_refused(tmp_path):
    source = export_onnx(MLP, tmp_path)
    with pytest.raises(ImportRefused, match=r"--image-input a: the input must be FP32 \[-1, 1, H, W\]"):
        import_tensor_model(ImportRequest(source, "mlp", "1", tmp_path / "repo",
                                          image=ImageFlags("a", (0.5,), (0.25,), 64)))


def test_golden_bytes_are_little_endian_rows(mlp_manifest):
    case = mlp_manifest["tensor"]["golden"][0]["inputs"][0]
    data = np.frombuffer(base64.b64decode(case["data_b64"]), "<f4").reshape(case["shape"])
    assert data.shape == (1, 4) and np.isfinite(data).all()
    assert TensorIO("a", "FP32", (-1, 4)).accepts((3, 4)) and not TensorIO("a", "FP32", (-1, 4)).accepts((0, 4))
