"""The official Triton client, unchanged, against the gateway's KServe v2 endpoint.

tritonclient pins an older protobuf than the project's, so it runs in its own virtualenv
(`.venv-tritonclient/` at the repository root, built once from PyPI and reused) as a separate
process executing `triton_client_script.py` against a real mesh.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import session_tls
from tests.support.gateway_fixtures import tenant, write_tenants
from tests.support.processes import ROOT, running_mesh

pytestmark = pytest.mark.integration

# 2.71.0: the newest tritonclient that installs on Python 3.11 (2.72.0 requires 3.12).
TRITONCLIENT_PIN = "2.71.0"
VENV = ROOT / ".venv-tritonclient"
SCRIPT = Path(__file__).with_name("triton_client_script.py")
API_KEY = "triton-test-key"


@pytest.fixture(scope="session")
def triton_python() -> Path:
    python = VENV / "bin" / "python"
    marker = VENV / f".installed-tritonclient-{TRITONCLIENT_PIN}"
    if marker.exists():
        return python
    shutil.rmtree(VENV, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(VENV)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"tritonclient[grpc]=={TRITONCLIENT_PIN}"],
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            shutil.rmtree(VENV, ignore_errors=True)
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            pytest.skip(f"cannot install tritonclient[grpc]=={TRITONCLIENT_PIN} into {VENV.name}: {tail}")
    marker.touch()
    return python


def test_official_tritonclient_reads_metadata_infers_raw_uint8_and_gets_errors(tmp_path, triton_python):
    tenants = write_tenants(tmp_path / "tenants.yaml", [tenant("triton", API_KEY)])
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_gateway("--tenants-file", str(tenants))
        # Over TLS, verifying the gateway with the session's dev CA, as a tenant of a TLS gateway would.
        done = subprocess.run([str(triton_python), str(SCRIPT), mesh.gateway.address, API_KEY,
                               str(session_tls.session_pki().ca_path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr + mesh.logs()
    seen = json.loads(done.stdout)

    assert (seen["live"], seen["ready"], seen["model_ready"]) == (True, True, True)
    metadata = seen["metadata"]
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == (
        "toy-classifier", ["1"], "infermesh_classifier"
    )
    assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": ["-1", "-1", "-1"]}]
    assert metadata["outputs"] == [
        {"name": "PROBABILITIES", "datatype": "FP32", "shape": ["2"]},
        {"name": "LABELS", "datatype": "BYTES", "shape": ["2"]},
    ]

    assert seen["response_id"] == "triton-1"
    assert seen["labels"] == ["dark", "bright"]
    dark, bright = seen["probabilities"]
    assert bright > dark and abs(dark + bright - 1) < 1e-3
    (top1,) = seen["top1"]
    assert top1.split(":")[1:] == ["1", "bright"]

    assert seen["unknown_model"] == {"status": "StatusCode.NOT_FOUND", "message": "model 'nope' is not served here"}
    assert seen["wrong_key"] == {"status": "StatusCode.UNAUTHENTICATED", "message": "invalid API key"}
