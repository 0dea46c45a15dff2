"""The official Triton client, unchanged, against the gateway's KServe v2 endpoints (gRPC and HTTP).

tritonclient pins an older protobuf than the project's, so it runs in its own virtualenv
(`.venv-tritonclient/` at the repository root, built once from PyPI and reused) as separate
processes executing `triton_client_script.py` / `triton_v2_script.py` against one real mesh
(scheduler, toy classifier and generator workers, a TLS gateway with tenants and its HTTP port).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support.side_venv import side_venv_python
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import tenant, write_tenants
from tools.testbed.processes import free_port, running_mesh

pytestmark = pytest.mark.integration

# 2.71.0: the newest tritonclient that installs on Python 3.11 (2.72.0 requires 3.12).
TRITONCLIENT_PIN = "2.71.0"
# The HTTP client brings geventhttpclient. Built in the background from collection on (tests/conftest.py).
SIDE_VENV = ("tritonclient", f"tritonclient[grpc,http]=={TRITONCLIENT_PIN}")
SCRIPT = Path(__file__).with_name("triton_client_script.py")
V2_SCRIPT = Path(__file__).with_name("triton_v2_script.py")
API_KEY = "triton-test-key"
# The scheduler's dynamic batching, which ModelConfig must report as it is (not invented numbers).
MAX_QUEUE_DELAY_MS = 3
PREFERRED_BATCH_SIZES = (2, 4)


@pytest.fixture(scope="session")
def triton_python() -> Path:
    return side_venv_python(*SIDE_VENV)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tritonclient")
    tenants = write_tenants(tmp / "tenants.yaml", [tenant("triton", API_KEY)])
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler("--max-queue-delay-ms", str(MAX_QUEUE_DELAY_MS),
                             "--preferred-batch-sizes", ",".join(map(str, PREFERRED_BATCH_SIZES)))
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        mesh.http_port = free_port()
        mesh.start_gateway("--tenants-file", str(tenants), "--http-port", str(mesh.http_port))
        yield mesh


def _run(triton_python: Path, mesh, script: Path, *args: str) -> dict:
    # Over TLS, verifying the gateway with the session's dev CA, as a tenant of a TLS gateway would.
    done = subprocess.run([str(triton_python), str(script), *args], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr + mesh.logs()
    return json.loads(done.stdout)


def test_official_tritonclient_reads_metadata_infers_raw_uint8_and_gets_errors(mesh, triton_python):
    seen = _run(triton_python, mesh, SCRIPT, mesh.gateway.address, API_KEY, str(session_tls.session_pki().ca_path))

    assert (seen["live"], seen["ready"], seen["model_ready"]) == (True, True, True)
    metadata = seen["metadata"]
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == (
        "toy-classifier", ["1"], "infermesh_classifier"
    )
    assert metadata["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": ["-1", "8", "8", "3"]}]
    assert metadata["outputs"] == [
        {"name": "PROBABILITIES", "datatype": "FP32", "shape": ["-1", "2"]},
        {"name": "LABELS", "datatype": "BYTES", "shape": ["-1", "2"]},
    ]

    assert seen["response_id"] == "triton-1"
    assert seen["labels"] == ["dark", "bright"]
    dark, bright = seen["probabilities"]
    assert bright > dark and abs(dark + bright - 1) < 1e-3
    (top1,) = seen["top1"]
    assert top1.split(":")[1:] == ["1", "bright"]

    assert seen["unknown_model"] == {"status": "StatusCode.NOT_FOUND", "message": "model 'nope' is not served here"}
    assert seen["wrong_key"] == {"status": "StatusCode.UNAUTHENTICATED", "message": "invalid API key"}


def test_official_tritonclient_grpc_and_http_config_statistics_index_batches_and_stream(mesh, triton_python):
    seen = _run(triton_python, mesh, V2_SCRIPT, mesh.gateway.address, f"127.0.0.1:{mesh.http_port}", API_KEY,
                str(session_tls.session_pki().ca_path))
    grpc, http = seen["grpc"], seen["http"]

    # An input built from the metadata alone is valid at batch 1 and 4; outputs lead with the batch.
    for client in (grpc, http):
        assert client["batch1"] == {"shape": [1, 2], "argmax": [1], "labels_shape": [1, 2]}
        assert client["batch4"] == {"shape": [4, 2], "argmax": [1, 0, 1, 0], "labels_shape": [4, 2]}
    assert grpc["metadata_input"] == {"name": "IMAGE", "datatype": "UINT8", "shape": ["-1", "8", "8", "3"]}
    assert http["metadata"]["inputs"] == [{"name": "IMAGE", "datatype": "UINT8", "shape": [-1, 8, 8, 3]}]

    # The configuration reports the batching the scheduler runs (its flags), dims without the batch.
    config = grpc["config"]
    assert (config["name"], config["max_batch_size"], config["input"][0]["dims"]) == (
        "toy-classifier", 8, ["8", "8", "3"])
    assert config["dynamic_batching"] == {
        "preferred_batch_size": list(PREFERRED_BATCH_SIZES),
        "max_queue_delay_microseconds": str(MAX_QUEUE_DELAY_MS * 1000)}
    assert [o["name"] for o in config["output"]] == ["PROBABILITIES", "LABELS"]
    assert http["config"]["dynamic_batching"]["max_queue_delay_microseconds"] == MAX_QUEUE_DELAY_MS * 1000
    assert http["config"]["max_batch_size"] == 8
    generator = grpc["generator_config"]
    # Decoupled, no batch dimension (max_batch_size 0, left out of the JSON as a default); the
    # scheduler's continuous batching limits as parameters.
    assert ("max_batch_size" not in generator, generator["model_transaction_policy"]) == (True, {"decoupled": True})
    assert generator["parameters"]["max_num_seqs"] == {"string_value": "32"}
    assert grpc["too_large"]["status"] == "StatusCode.INVALID_ARGUMENT"
    assert "takes at most 8 per request" in grpc["too_large"]["message"]
    assert grpc["unknown_config"] == {"status": "StatusCode.NOT_FOUND", "message": "model 'nope' is not served here"}

    index = {(m["name"], m["version"], m["state"]) for m in grpc["index"]}
    assert index == {("toy-classifier", "1", "READY"), ("toy-generator", "1", "READY")}
    assert {(m["name"], m["state"]) for m in http["index"]} == {("toy-classifier", "READY"),
                                                                 ("toy-generator", "READY")}

    # Statistics (this gateway's, since it started): between the gRPC and the HTTP reading, the HTTP
    # client ran a request of 1 image and one of 4. The batch of 64, refused before inference, is not counted.
    (stats,) = grpc["statistics"]
    assert (stats["name"], stats["version"]) == ("toy-classifier", "1")
    assert int(stats["inference_count"]) >= 5 and int(stats["execution_count"]) >= 2
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == stats["execution_count"] and int(inference["success"]["ns"]) > 0
    assert inference["queue"]["count"] == stats["execution_count"] and int(inference["compute_infer"]["ns"]) > 0
    assert inference["fail"] == {}
    (http_stats,) = http["statistics"]
    assert (http_stats["inference_count"] - int(stats["inference_count"]),
            http_stats["execution_count"] - int(stats["execution_count"])) == (5, 2)
    assert http_stats["last_inference"] >= int(stats["last_inference"]) > 0

    # ModelStreamInfer: one response per chunk, the last flagged final; errors stay per request.
    first = grpc["stream"]["first"]
    assert first["finals"] == 1 and len(first["chunks"]) >= 2 and "".join(first["chunks"])
    assert first["parameters"]["finish_reason"] == "length"
    assert first["parameters"]["completion_tokens"] == "6"
    assert grpc["stream"]["unknown_model"] == {"error": "model 'nope' is not served here"}
    assert grpc["stream"]["bad_parameter"] == {
        "error": "parameter 'max_tokens' has an unusable value 'many'; expected an integer >= 1"}
    after = grpc["stream"]["after_errors_empty_final"]
    assert after["finals"] == 1 and after["chunks"], "the stream still serves after two failed requests"
    (generated,) = grpc["generator_statistics"]
    assert (generated["inference_count"], generated["execution_count"]) == ("2", "2")

    assert (http["live"], http["ready"], http["model_ready"]) == (True, True, True)
    assert http["unknown_model"] == {"status": "404", "message": "model 'nope' is not served here"}
    assert http["wrong_key"] == {"status": "401", "message": "invalid API key"}
