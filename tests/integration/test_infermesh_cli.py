"""Admin/GetStatus on real processes, and the infermesh command end to end (subprocess, --json).

One mesh for the module, all TLS with the session's dev CA: a scheduler and two toy workers whose
operator identity is the session's worker certificate (--tls-allowed-admin-ids; the session CA issues
no operator certificate, and which id holds the role is what the flag configures), and a gateway with
a tenants file holding an admin tenant and an ordinary one.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys

import grpc
import pytest
from PIL import Image

from infermesh.v1 import admin_pb2, admin_pb2_grpc
from services.common import admin_servicer
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import bearer, tenant, write_tenants
from tools.testbed.processes import ROOT, running_mesh, wait_until

pytestmark = pytest.mark.integration

ADMIN_KEY, USER_KEY = "ops-secret-key-0123", "app-secret-key-0123"
OPERATOR = "worker"  # the session certificate acting as the operator identity here
OPERATOR_ID = "spiffe://infermesh/worker"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("infermesh-cli")
    tenants = write_tenants(tmp / "tenants.yaml", [
        {**tenant("ops", ADMIN_KEY, "critical"), "admin": True},
        tenant("app", USER_KEY),
    ])
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler("--tls-allowed-admin-ids", OPERATOR_ID)
        mesh.workers = [mesh.start_worker(model, "--tls-allowed-admin-ids", OPERATOR_ID)
                        for model in ("toy-classifier", "toy-generator")]
        mesh.start_gateway("--tenants-file", str(tenants), "--pressure-poll-interval-ms", "200")
        yield mesh


def get_status(address: str, identity: str | None = "gateway", metadata=()) -> admin_pb2.ServiceStatus:
    with session_tls.channel(address, identity) as channel:
        return admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=10,
                                                           metadata=metadata)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code()


def infermesh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    pki = session_tls.session_pki()
    tls = ["--ca-file", str(pki.ca_path), "--cert-file", str(pki.files[OPERATOR].cert_path),
           "--key-file", str(pki.files[OPERATOR].key_path)]
    command, *rest = args
    return subprocess.run([sys.executable, "-m", "services.cli", command, *tls, *rest], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


def test_gateway_status_needs_an_admin_tenants_key(mesh):
    address = mesh.gateway.address
    assert code_of(lambda: get_status(address)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: get_status(address, metadata=bearer("not-a-key"))) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: get_status(address, metadata=bearer(USER_KEY))) == grpc.StatusCode.PERMISSION_DENIED
    assert get_status(address, metadata=bearer(ADMIN_KEY)).service == "gateway"


def test_scheduler_and_worker_status_need_an_operator_identity(mesh):
    for process in (mesh.scheduler, *mesh.workers):
        assert code_of(lambda p=process: get_status(p.address, "gateway")) == grpc.StatusCode.PERMISSION_DENIED
        assert get_status(process.address, OPERATOR).service == process.service


def test_status_json_shows_what_is_in_force_and_no_secrets(mesh):
    wait_until(lambda: "healthy" in infermesh("status", "--gateway", mesh.gateway.address, "--api-key", ADMIN_KEY).stdout,
               timeout_s=15, interval_s=0.3, message="gateway reports its scheduler healthy")
    run = infermesh("status", "--json", "--gateway", mesh.gateway.address, "--scheduler", mesh.scheduler.address,
                    *[arg for w in mesh.workers for arg in ("--worker", w.address)], "--api-key", ADMIN_KEY)
    assert run.returncode == 0, run.stderr
    gateway, scheduler, classifier, generator = json.loads(run.stdout)["services"]
    assert [s["address"] for s in gateway["schedulers"]] == [mesh.scheduler.address]
    assert {(t["id"], t["admin"], t["priority"]) for t in gateway["tenants"]} == {("ops", True, "critical"),
                                                                                ("app", False, "standard")}
    assert {m["model"] for m in gateway["models"]} == {"toy-classifier", "toy-generator"}
    assert gateway["tls"] == "server TLS"
    assert {(w["model"], w["state"]) for w in scheduler["workers"]} == {("toy-classifier", "ready"),
                                                                      ("toy-generator", "ready")}
    assert (scheduler["tls"], scheduler["draining"]) == ("mTLS", False)
    assert (classifier["model"], classifier["state"], generator["model"]) == ("toy-classifier", "ready", "toy-generator")
    for secret in (ADMIN_KEY, USER_KEY, "api_key", "sha256"):
        assert secret not in run.stdout


def test_status_exits_1_when_a_target_refuses(mesh):
    run = infermesh("status", "--json", "--gateway", mesh.gateway.address, "--api-key", USER_KEY)
    assert run.returncode == 1
    error = json.loads(run.stdout)["services"][0]["error"]
    assert error["code"] == "PERMISSION_DENIED" and "tenant 'app'" in error["message"]


def test_classify_and_generate_through_the_gateway(mesh, tmp_path):
    png = tmp_path / "bright.png"
    buffer = io.BytesIO()
    Image.new("L", (8, 8), color=250).save(buffer, format="PNG")
    png.write_bytes(buffer.getvalue())
    env = {"INFERMESH_API_KEY": USER_KEY, "PATH": "/usr/bin:/bin"}
    run = infermesh("classify", str(png), "--model", "toy-classifier", "--gateway", mesh.gateway.address, "--json",
                    env=env)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["labels"][0]["label"] == "bright"
    served = admin_servicer.from_proto(get_status(mesh.workers[0].address, OPERATOR)).section("served")
    assert served.records()[0]["kind"] == "classify" and served.records()[0]["num_items_ok"] >= 1

    run = infermesh("generate", "abc", "--model", "toy-generator", "--max-tokens", "5", "--stream", "--json",
                    "--gateway", mesh.gateway.address, env=env)
    assert run.returncode == 0, run.stderr
    chunks = [json.loads(line) for line in run.stdout.splitlines()]
    assert "".join(c["text"] for c in chunks) and chunks[-1]["finish_reason"] == "length"
    assert [c["index"] for c in chunks] == sorted(c["index"] for c in chunks)


def test_plaintext_scheduler_answers_a_loopback_caller(tmp_path):
    with running_mesh(tmp_path, tls=False) as plain:
        scheduler = plain.start_scheduler()
        run = subprocess.run([sys.executable, "-m", "services.cli", "status", "--gateway", "", "--scheduler",
                              scheduler.address, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    (status,) = json.loads(run.stdout)["services"]
    assert (status["service"], status["tls"], status["models"]) == ("scheduler", "off", [])
