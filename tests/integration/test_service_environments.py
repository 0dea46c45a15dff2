"""Each service runs from an environment built from its own dependency set alone
(requirements/<service>.txt, what its image installs): the gateway and the scheduler without
torch, numba or numpy, none of them with test or development tools. A real request crosses all
three: a PNG digit through gateway -> scheduler -> a worker serving the shipped `digits` model."""

from __future__ import annotations

import io
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.processes import ROOT, ServiceProcess, free_port

# Building the worker environment unpacks torch (about 1.3 GB): minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]
SERVICES = ("gateway", "scheduler", "worker")
TENANTS = ROOT / "deploy/local/tenants.yaml"
AUTH = (("authorization", "Bearer demo-key-alpha"),)


def _build(root: Path, service: str) -> str:
    """A fresh venv holding exactly requirements/<service>.txt; returns its python."""
    venv = root / f"venv-{service}"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    # This environment's pip installs into the new one (no ensurepip run per venv).
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--disable-pip-version-check", "--no-compile",
         "-r", str(ROOT / "requirements" / f"{service}.txt")],
        capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return python


@pytest.fixture(scope="module")
def pythons(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("service-envs")
    with ThreadPoolExecutor(len(SERVICES)) as pool:  # mostly waiting on disk: build them side by side
        built = dict(zip(SERVICES, pool.map(lambda s: _build(root, s), SERVICES), strict=True))
    return built


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
