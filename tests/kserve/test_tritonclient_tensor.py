"""The official Triton client, unchanged, against tensor models (TorchScript, ONNX) served by the mesh.

tritonclient builds every request from ModelMetadata alone (tests/kserve/triton_tensor_script.py,
in its own virtualenv, as test_tritonclient.py explains) over gRPC and HTTP; its outputs are
compared here with the same runtime called directly on the same inputs (one thread, as the
workers run), within 1e-6 absolute (a row may be batched with others' rows in the mesh).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from services.worker.repository.loader import load_model
from tests.support.side_venv import side_venv_python
from tests.support.tensor_models import CNN, MLP, SEQ, import_model
from tools.testbed import session_tls
from tools.testbed.processes import free_port, running_mesh, wait_all_serving

pytestmark = pytest.mark.integration

TRITONCLIENT_PIN = "2.71.0"  # as test_tritonclient.py
SIDE_VENV = ("tritonclient", f"tritonclient[grpc,http]=={TRITONCLIENT_PIN}")  # built from collection on
SCRIPT = Path(__file__).with_name("triton_tensor_script.py")
SERVED = (("cnn", CNN, "onnx"), ("mlp", MLP, "torchscript"), ("seq", SEQ, "onnx"), ("seq", SEQ, "torchscript"))


@pytest.fixture(scope="module")
def triton_python() -> Path:
    return side_venv_python(*SIDE_VENV)


def test_tritonclient_infers_each_tensor_model_from_its_metadata_alone(tmp_path, triton_python):
    exports, root = tmp_path / "exports", tmp_path / "repo"
    exports.mkdir()
    for _, model, fmt in SERVED:
        import_model(model, fmt, exports, root)
    models = [f"{name}-{fmt}" for name, _, fmt in SERVED]
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler("--max-queue-delay-ms", "2")
        wait_all_serving([mesh.start_worker(model, "--model-repository", str(root), "--num-threads", "1", wait=False)
                          for model in models])
        http_port = free_port()
        mesh.start_gateway("--http-port", str(http_port))
        done = subprocess.run(
            [str(triton_python), str(SCRIPT), mesh.gateway.address, f"127.0.0.1:{http_port}",
             str(session_tls.session_pki().ca_path), str(tmp_path), *models],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr + mesh.logs()
    seen = json.loads(done.stdout)
    for model in models:
        saved = np.load(tmp_path / f"{model}.npz")
        inputs = {k.removeprefix("in."): saved[k] for k in saved.files if k.startswith("in.")}
        want = load_model(root, model, "1", num_threads=1).tensor.run(inputs)
        assert set(inputs) == {t["name"] for t in seen[model]["metadata"]["inputs"]}
        for name, array in want.items():
            for protocol in ("grpc", "http"):
                got = saved[f"{protocol}.{name}"]
                assert got.shape == array.shape and got.dtype == array.dtype, (model, protocol, name)
                np.testing.assert_allclose(got, array, rtol=0, atol=1e-6)
