"""Tensor models (TorchScript, ONNX) through gateway -> scheduler -> worker, over KServe v2 gRPC and REST.

The models are exported here and imported as `infermesh models import` does. Outputs through the
mesh are compared with the same runtime (same file, one thread, as the workers run) called
directly on the same rows. A row's result may depend on how many rows share its batch (the BLAS
kernel picked for a batch of 1 vs 8 may round differently), and the batches the mesh forms
depend on timing, so the comparison is within 1e-6 absolute (outputs are O(1)); the rows' own
inputs, shapes and order are checked exactly.
"""

from __future__ import annotations

import json
import ssl
import struct
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference import grpc_predict_v2_pb2 as kserve
from inference import grpc_predict_v2_pb2_grpc as kserve_grpc
from services.worker.repository.loader import load_model
from tests.support.tensor_models import CNN, MLP, SEQ, import_model, install_unloadable
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_all_serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]
MAX_BATCH_SIZE = 8
TOLERANCE = 1e-6
SERVED = (("cnn", "onnx"), ("cnn", "torchscript"), ("mlp", "onnx"), ("seq", "onnx"), ("seq", "torchscript"))


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    exports, root = tmp_path_factory.mktemp("exports"), tmp_path_factory.mktemp("repo")
    models = {"cnn": CNN, "mlp": MLP, "seq": SEQ}
    for name, fmt in SERVED:
        import_model(models[name], fmt, exports, root, max_batch_size=MAX_BATCH_SIZE)
    return root


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, repository):
    with running_mesh(tmp_path_factory.mktemp("mesh")) as mesh:
        mesh.start_scheduler("--max-queue-delay-ms", "5")
        wait_all_serving([mesh.start_worker(f"{name}-{fmt}", "--model-repository", str(repository), "--num-threads", "1",
                                            wait=False) for name, fmt in SERVED])
        mesh.http_port = free_port()
        mesh.start_gateway("--http-port", str(mesh.http_port))
        yield mesh


@pytest.fixture(scope="module")
def stub(mesh):
    with session_tls.channel(mesh.gateway.address) as channel:
        yield kserve_grpc.GRPCInferenceServiceStub(channel)


def direct(repository: Path, model: str):
    return load_model(repository, model, "1", num_threads=1).tensor


def infer_request(model: str, arrays: dict[str, np.ndarray], *, typed: bool = False) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name=model)
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(np.float64): "FP64"}
    for name, array in arrays.items():
        tensor = request.inputs.add(name=name, datatype=datatypes[array.dtype], shape=list(array.shape))
        if typed:
            field = {"FP32": "fp32_contents", "INT64": "int64_contents", "FP64": "fp64_contents"}[tensor.datatype]
            getattr(tensor.contents, field).extend(array.ravel().tolist())
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    return request


def outputs_of(response: kserve.ModelInferResponse) -> dict[str, np.ndarray]:
    dtypes = {"FP32": np.float32, "INT64": np.int64}
    return {t.name: np.frombuffer(raw, dtypes[t.datatype]).reshape(list(t.shape))
            for t, raw in zip(response.outputs, response.raw_output_contents, strict=True)}


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_batch_1_and_batch_8_mixed_across_concurrent_callers_match_the_runtime_called_directly(
        stub, repository, fmt):
    model = f"cnn-{fmt}"
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((1 if i % 3 else 8, 1, 8, 8), np.float32) for i in range(48)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        replies = list(pool.map(lambda x: stub.ModelInfer(infer_request(model, {"x": x}), timeout=30), inputs))
    runtime = direct(repository, model)
    for x, reply in zip(inputs, replies, strict=True):
        got = outputs_of(reply)["probs"]
        assert got.shape == (x.shape[0], 10)
        want = np.concatenate([runtime.run({"x": x[i:i + 1]})["probs"] for i in range(x.shape[0])])
        np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_mixed_sequence_lengths_from_concurrent_callers_each_get_their_own_shape(stub, repository, fmt):
    model = f"seq-{fmt}"
    rng = np.random.default_rng(8)
    inputs = [rng.integers(0, 16, (1 + i % 2 * 3, 2 + i % 5), dtype=np.int64) for i in range(40)]
    with ThreadPoolExecutor(max_workers=12) as pool:
        replies = list(pool.map(lambda t: stub.ModelInfer(infer_request(model, {"tokens": t}), timeout=30), inputs))
    runtime = direct(repository, model)
    for tokens, reply in zip(inputs, replies, strict=True):
        got = outputs_of(reply)
        assert got["logits"].shape == (tokens.shape[0], tokens.shape[1], 5)
        want = runtime.run({"tokens": tokens})
        np.testing.assert_allclose(got["pooled"], want["pooled"], rtol=0, atol=TOLERANCE)
        np.testing.assert_allclose(got["logits"], want["logits"], rtol=0, atol=TOLERANCE)


def test_two_inputs_in_typed_contents_and_two_outputs(stub, repository):
    rng = np.random.default_rng(9)
    a, b = rng.standard_normal((3, 4), np.float32), rng.standard_normal((3, 3), np.float32)
    reply = stub.ModelInfer(infer_request("mlp-onnx", {"a": a, "b": b}, typed=True), timeout=30)
    got = outputs_of(reply)
    assert [t.name for t in reply.outputs] == ["y", "norm"]
    want = direct(repository, "mlp-onnx").run({"a": a, "b": b})
    np.testing.assert_allclose(got["y"], want["y"], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(got["norm"], want["norm"], rtol=0, atol=TOLERANCE)


def test_the_classification_extension_ranks_a_score_vector(stub):
    x = np.random.default_rng(10).standard_normal((2, 1, 8, 8), np.float32)
    request = infer_request("cnn-onnx", {"x": x})
    request.outputs.add(name="probs").parameters["classification"].int64_param = 3
    plain = outputs_of(stub.ModelInfer(infer_request("cnn-onnx", {"x": x}), timeout=30))["probs"]
    reply = stub.ModelInfer(request, timeout=30)
    assert (reply.outputs[0].datatype, list(reply.outputs[0].shape)) == ("BYTES", [2, 3])
    raw, entries = reply.raw_output_contents[0], []
    while raw:
        (length,) = struct.unpack_from("<I", raw)
        entries.append(raw[4:4 + length].decode())
        raw = raw[4 + length:]
    for row, ranked in zip(plain, (entries[:3], entries[3:]), strict=True):
        assert [int(e.split(":")[1]) for e in ranked] == list(np.argsort(-row, kind="stable")[:3])


@pytest.mark.parametrize(("edit", "message"), [
    (lambda r: setattr(r.inputs[0], "datatype", "FP64"), "input 'a' must be FP32, got FP64"),
    (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12), "input 'a' FP32 [1, 4] needs 16 bytes"),
    (lambda r: (r.inputs.pop(), r.raw_input_contents.pop()), "missing input(s) ['b']"),
    (lambda r: (r.inputs.add(name="c", datatype="FP32", shape=[1, 1]), r.raw_input_contents.append(b"\0" * 4)),
     "unexpected input(s) ['c']"),
    (lambda r: r.inputs[0].shape.__setitem__(1, 5), "input 'a' must have shape [-1, 4] (-1: any size >= 1)"),
], ids=["datatype", "element-count", "missing", "extra", "shape"])
def test_bad_input_is_invalid_argument_naming_the_input(stub, edit, message):
    request = infer_request("mlp-onnx", {"a": np.zeros((1, 4), np.float32), "b": np.zeros((1, 3), np.float32)})
    edit(request)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in refused.value.details()


def test_a_batch_above_max_batch_size_is_refused_naming_the_input(stub):
    x = np.zeros((MAX_BATCH_SIZE + 1, 1, 8, 8), np.float32)
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(infer_request("cnn-onnx", {"x": x}), timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"input 'x' has a batch of 9; the model takes at most {MAX_BATCH_SIZE}" in refused.value.details()


def test_metadata_config_and_statistics_describe_the_tensor_model(stub):
    metadata = stub.ModelMetadata(kserve.ModelMetadataRequest(name="seq-onnx"), timeout=10)
    assert metadata.platform == "infermesh_tensor"
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("tokens", "INT64", [-1, -1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [
        ("pooled", "FP32", [-1, 8]), ("logits", "FP32", [-1, -1, 5])]
    config = stub.ModelConfig(kserve.ModelConfigRequest(name="mlp-onnx"), timeout=10).config
    assert config.max_batch_size == MAX_BATCH_SIZE
    assert [(i.name, kserve.DataType.Name(i.data_type), list(i.dims)) for i in config.input] == [
        ("a", "TYPE_FP32", [4]), ("b", "TYPE_FP32", [3])]
    stub.ModelInfer(infer_request("mlp-onnx", {"a": np.zeros((2, 4), np.float32), "b": np.zeros((2, 3), np.float32)}),
                    timeout=30)
    stats = stub.ModelStatistics(kserve.ModelStatisticsRequest(name="mlp-onnx"), timeout=10).model_stats[0]
    assert stats.inference_count >= 2 and stats.inference_stats.success.count >= 1


def test_rest_infer_with_json_data_matches_grpc(mesh, stub, repository):
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((2, 4), np.float32), rng.standard_normal((2, 3), np.float32)
    body = {"inputs": [{"name": "a", "datatype": "FP32", "shape": [2, 4], "data": a.ravel().tolist()},
                       {"name": "b", "datatype": "FP32", "shape": [2, 3], "data": b.tolist()}]}
    request = urllib.request.Request(f"https://127.0.0.1:{mesh.http_port}/v2/models/mlp-onnx/infer",
                                     data=json.dumps(body).encode(), method="POST")
    context = ssl.create_default_context(cafile=str(session_tls.session_pki().ca_path))
    with urllib.request.urlopen(request, timeout=30, context=context) as reply:
        document = json.loads(reply.read())
    outputs = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in document["outputs"]}
    want = direct(repository, "mlp-onnx").run({"a": a, "b": b})
    np.testing.assert_allclose(outputs["y"], want["y"], rtol=0, atol=TOLERANCE)
    bad = {"inputs": [body["inputs"][0]]}
    request = urllib.request.Request(f"https://127.0.0.1:{mesh.http_port}/v2/models/mlp-onnx/infer",
                                     data=json.dumps(bad).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30, context=context)
    assert refused.value.code == 400 and "missing input(s) ['b']" in refused.value.read().decode()


def test_a_worker_whose_onnx_model_has_an_op_the_runtime_lacks_exits_2_naming_the_op(tmp_path, repository):
    root = tmp_path / "repo"
    install_unloadable(root, "bad", repository / "cnn-onnx" / "1" / "manifest.json", "FrobnicateV2")
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        worker = mesh.start_worker("bad", "--model-repository", str(root), wait=False)
        assert worker.proc is not None
        assert worker.proc.wait(timeout=60) == 2
        assert "cannot run op 'FrobnicateV2'" in worker.log_tail()
