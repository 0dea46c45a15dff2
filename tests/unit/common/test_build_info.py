"""Which build runs: `--version` and the *_build_info gauge say the same."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from prometheus_client import REGISTRY

from services.common import build_info
from tools.testbed.processes import ROOT


def test_version_is_the_one_in_pyproject():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert build_info.VERSION == pyproject["project"]["version"]


def test_current_reads_the_revision_variable():
    info = build_info.current({build_info.REVISION_ENV: " 4cfefa3 "})
    assert info.version == build_info.VERSION and info.revision == "4cfefa3"
    assert build_info.current({}).revision == "unknown"


def test_gauge_is_one_with_the_build_in_its_labels():
    info = build_info.BuildInfo("9.9.9", "abc123", "3.11.0", "1.0.0")
    build_info.export("testsvc", info)
    labels = {"version": "9.9.9", "revision": "abc123", "python_version": "3.11.0", "grpc_version": "1.0.0"}
    assert REGISTRY.get_sample_value("infermesh_testsvc_build_info", labels) == 1.0


def test_every_service_prints_its_version_and_exits_0():
    for service in ("gateway", "scheduler", "worker"):
        done = subprocess.run([sys.executable, "-m", f"services.{service}", "--version"], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"infermesh {service} {build_info.VERSION} (revision "), done.stdout
