"""Each service runs from an environment built from its own dependency set alone
(requirements/<service>.txt, what its image installs): the gateway and the scheduler without
torch, numba or numpy, none of them with test or development tools. A real request crosses all
three: a PNG digit through gateway -> scheduler -> a worker serving the shipped `digits` model.

Each environment is a fresh venv holding exactly the distributions its set pins, linked file by file
(a directory only one distribution owns: as a whole) from this environment, where requirements.lock
installed the same versions (tests/unit/test_service_requirements.py: the set's pins are the lock's
and it is closed under dependencies). So it has what `pip install -r requirements/<service>.txt`
would install, and nothing else is importable; `pip check` confirms every distribution's own
requirements are met in it. Unpacking torch again per run cost minutes on a loaded 2-core machine."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from PIL import Image

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.processes import ROOT, ServiceProcess, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SERVICES = ("gateway", "scheduler", "worker")
TENANTS = ROOT / "deploy/local/tenants.yaml"
AUTH = (("authorization", "Bearer demo-key-alpha"),)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


@dataclass(frozen=True)
class _Installed:
    version: str
    files: tuple[str, ...]  # as its RECORD lists them, relative to site-packages


def _installed(site: Path) -> dict[str, _Installed]:
    """Every distribution in `site` by canonical name, read from its METADATA and RECORD as text
    (importlib.metadata's file lists took a minute for this environment on a loaded machine)."""
    found = {}
    for info in site.glob("*.dist-info"):
        headers = dict(line.split(": ", 1) for line in (info / "METADATA").read_text(errors="replace")
                       .split("\n\n", 1)[0].splitlines() if ": " in line)
        files = tuple(row[0] for row in csv.reader((info / "RECORD").read_text().splitlines()) if row)
        found[canonicalize_name(headers["Name"])] = _Installed(headers["Version"], files)
    return found


def _build(root: Path, service: str, site: Path, installed: dict[str, _Installed]) -> str:
    """A fresh venv holding exactly requirements/<service>.txt (linked from `site`); returns its python."""
    owners: dict[str, set[str]] = {}  # top-level entry of site -> the distributions with files in it
    for name, dist in installed.items():
        for file in dist.files:
            owners.setdefault(file.split("/", 1)[0], set()).add(name)
    venv = root / f"venv-{service}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    own_site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    for name, version in _pins(ROOT / "requirements" / f"{service}.txt").items():
        dist = installed[name]
        # "==2.13.0" admits torch's "2.13.0+cpu", as pip does.
        assert SpecifierSet(f"=={version}").contains(dist.version), (
            f"{name}: this environment has {dist.version}, requirements/{service}.txt pins {version}")
        for file in dist.files:
            top = file.split("/", 1)[0]
            if top == "..":
                continue  # console scripts outside site-packages: services run with python -m
            relative = top if "/" in file and owners[top] == {name} else file  # a directory only it owns: whole
            link = own_site / relative
            if link.is_symlink() or not (site / relative).exists():
                continue  # linked already as part of a whole directory, or listed and since removed
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(site / relative)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", python, "check", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return python


@pytest.fixture(scope="module")
def pythons(tmp_path_factory) -> dict[str, str]:
    site = Path(sysconfig.get_paths()["purelib"])
    root, installed = tmp_path_factory.mktemp("service-envs"), _installed(site)
    return {service: _build(root, service, site, installed) for service in SERVICES}


def _importable(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=120).returncode == 0


@pytest.mark.parametrize("service", ["gateway", "scheduler"])
def test_edge_and_scheduler_environments_hold_no_compute_or_dev_tools(pythons, service):
    for module in ("torch", "numba", "numpy", "pytest", "sklearn"):
        assert not _importable(pythons[service], module), f"{service} environment has {module}"


def test_a_request_crosses_three_services_each_in_its_own_environment(pythons, tmp_path):
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'gen' / 'python'}", "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    processes: list[ServiceProcess] = []

    def start(service: str, args: list[str]) -> ServiceProcess:
        process = ServiceProcess(service, service, free_port(), args, env, tmp_path / f"{service}.log",
                                 python=pythons[service])
        processes.append(process.start())
        process.wait_serving(timeout_s=120)
        return process

    try:
        scheduler = start("scheduler", [])
        start("worker", ["--scheduler-address", scheduler.address, "--model-repository", str(ROOT / "model_repo"),
                         "--model-name", "digits", "--num-threads", "1"])
        gateway = start("gateway", ["--scheduler-address", scheduler.address, "--tenants-file", str(TENANTS)])
        pixels = np.zeros((32, 32, 3), dtype=np.uint8)
        pixels[6:26, 14:18] = 255  # a "1"
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        with session_tls.channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            reply = stub.Classify(gateway_pb2.ClassifyRequest(
                model=common_pb2.ModelRef(name="digits"), image=common_pb2.Image(encoded=png.getvalue()), top_k=3,
            ), timeout=60, metadata=AUTH, wait_for_ready=True)
        assert len(reply.labels) == 3 and reply.model.name == "digits"
        assert sum(label.score for label in reply.labels) <= 1.0 + 1e-6
    finally:
        for process in reversed(processes):
            process.stop()
