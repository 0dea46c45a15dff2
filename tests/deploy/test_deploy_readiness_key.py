"""`make up` with a tenants file that lacks its readiness key fails at once and says why, instead
of waiting out its whole timeout (the gateway refuses the key on every poll)."""

from __future__ import annotations

import subprocess
import sys
import time

from deploy_tools import REPO

from tools.mesh import key_problem, wait
from tools.testbed import session_tls
from tools.testbed.processes import running_mesh

DEMO_TENANTS = str(REPO / "deploy" / "local" / "tenants.yaml")


def test_the_demo_key_passes_with_the_demo_tenants_and_anything_passes_only_when_anonymous_is_allowed():
    assert key_problem(DEMO_TENANTS, "demo-key-alpha") is None
    assert key_problem("", "whatever", allow_anonymous=True) is None
    assert "MESH_ALLOW_ANONYMOUS=true" in key_problem("", "whatever"), "the gateway fails closed without a file"


def test_a_key_missing_from_the_file_is_named_with_the_fix(tmp_path):
    problem = key_problem(DEMO_TENANTS, "not-a-demo-key")
    assert "readiness key is not in" in problem and "MESH_API_KEY" in problem
    assert "not-a-demo-key" not in problem  # never echo a whole key
    assert "unusable" in key_problem(str(tmp_path / "missing.yaml"), "k")


def test_check_key_command_exits_1_with_the_reason():
    done = subprocess.run([sys.executable, "-m", "tools.mesh", "check-key", "--tenants-file", DEMO_TENANTS,
                           "--api-key", "wrong-key"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "MESH_API_KEY" in done.stderr


def test_wait_gives_up_at_once_when_the_gateway_refuses_the_key(tmp_path, capsys):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_gateway("--tenants-file", DEMO_TENANTS)
        started = time.monotonic()
        assert not wait([], mesh.gateway.address, ["digits"], timeout_s=60, api_key="wrong-key",
                        credentials=session_tls.credentials())
        assert time.monotonic() - started < 10  # not the 60 s timeout
    assert "refused the readiness key" in capsys.readouterr().err
