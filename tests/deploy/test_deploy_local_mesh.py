"""`make up`'s Procfile run for real, under honcho as the Makefile runs it, on free ports and with the
toy models: every process (two schedulers, the quota store, the gateway, two workers) becomes ready,
calls of both kinds go through, a scheduler that is killed is started again by `tools.mesh keep`
while the other serves, and stopping honcho stops every process it started. With TLS as `make up` sets
it: the services read their certificates from INFERMESH_<SERVICE>_TLS_* (the test session's dev CA)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
import pytest
from deploy_tools import REPO

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.mesh import is_serving, ready_models, store_answers, wait
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT
from tools.testbed.processes import free_port, wait_until

pytestmark = pytest.mark.integration

API_KEY = "demo-key-alpha"
METADATA = (("authorization", f"Bearer {API_KEY}"),)
GRPC_PORTS = ("MESH_GATEWAY_PORT", "MESH_SCHEDULER_PORT", "MESH_SCHEDULER2_PORT",
              "MESH_CLASSIFIER_PORT", "MESH_GENERATOR_PORT")
OTHER_PORTS = ("MESH_STORE_PORT", "MESH_GATEWAY_METRICS_PORT", "MESH_SCHEDULER_METRICS_PORT",
               "MESH_SCHEDULER2_METRICS_PORT", "MESH_CLASSIFIER_METRICS_PORT", "MESH_GENERATOR_METRICS_PORT")
READY_TIMEOUT_S = 120.0
TLS = session_tls.credentials()  # the gateway's certificate: the schedulers and workers want one


@dataclass
class LocalMesh:
    honcho: subprocess.Popen
    ports: dict[str, int]
    log_path: Path

    def address(self, variable: str) -> str:
        return f"127.0.0.1:{self.ports[variable]}"

    def started(self) -> list[psutil.Process]:
        """Every process under honcho (honcho puts each in its own session, so no one group holds them)."""
        try:
            return psutil.Process(self.honcho.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def service_pid(self, module: str, port: int) -> int:
        for process in self.started():
            try:
                argv = process.cmdline()
            except psutil.NoSuchProcess:
                continue
            # The service itself, not the `sh -c` or the `tools.mesh keep` above it.
            if argv[1:3] == ["-m", module] and f"{port}" in argv:
                return process.pid
        raise AssertionError(f"no {module} process on port {port}:\n{self.log_tail()}")

    def scheduler_with_workers(self) -> int:
        """The port of the scheduler the last worker attached to, from the workers' log lines."""
        attached = re.findall(r"attached to scheduler \S+ at 127\.0\.0\.1:(\d+)", self.log_path.read_text(errors="replace"))
        assert attached, self.log_tail()
        return int(attached[-1])

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])


@pytest.fixture
def local_mesh(tmp_path) -> Iterator[LocalMesh]:
    ports = {variable: free_port() for variable in GRPC_PORTS + OTHER_PORTS}
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MESH_", "INFERMESH_"))}
    env.update({variable: str(port) for variable, port in ports.items()})
    # As the Makefile runs it: the virtualenv's python first on PATH (the Procfile says `python`).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    for service, files in session_tls.session_pki().files.items():
        env.update(files.server_env(service))
    log_path = tmp_path / "mesh.log"
    with open(log_path, "wb") as log:
        honcho = subprocess.Popen(
            [str(Path(sys.executable).parent / "honcho"), "-f", "deploy/local/Procfile", "-d", ".", "start"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    mesh = LocalMesh(honcho, ports, log_path)
    try:
        yield mesh
    finally:
        started = mesh.started()
        honcho.send_signal(signal.SIGTERM)  # as `make down` does
        try:
            honcho.wait(timeout=30)
        finally:
            for process in started:  # only what this test started, by PID, if honcho left any
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass


def test_make_up_procfile_serves_survives_a_scheduler_kill_and_stops_cleanly(local_mesh):
    mesh = local_mesh
    health = [mesh.address(variable) for variable in GRPC_PORTS]
    ready = wait(health, mesh.address("MESH_GATEWAY_PORT"), ["toy-classifier", "toy-generator"],
                 READY_TIMEOUT_S, API_KEY, stores=[mesh.address("MESH_STORE_PORT")], credentials=TLS)
    assert ready, mesh.log_tail()
    assert store_answers(mesh.address("MESH_STORE_PORT"))

    with session_tls.channel(mesh.address("MESH_GATEWAY_PORT")) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)

        def serve_one_of_each() -> tuple[str, int]:
            label = stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="toy-classifier"),
                                                              image=BRIGHT), timeout=10, metadata=METADATA).labels[0].label
            request = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="toy-generator"), prompt="hello",
                                                  sampling=common_pb2.SamplingParams(max_tokens=8, ignore_eos=True))
            num_tokens = sum(len(chunk.token_ids) for chunk in stub.Generate(request, timeout=30, metadata=METADATA))
            return label, num_tokens

        # Right after ListModels reports both models ready, a call can still fail NOT_FOUND ("not
        # served here") for up to one pressure poll (1 s): the gateway's routing learns which
        # scheduler serves a model from its poll, and until then it tries any scheduler. Wait for
        # the first success, then expect every call to succeed.
        wait_until(lambda: _serves(serve_one_of_each), READY_TIMEOUT_S, interval_s=0.2, message="first calls served")
        assert serve_one_of_each() == ("bright", 8)

        # SIGKILL the scheduler the workers attached to: honcho alone would now stop every process;
        # under tools.mesh keep it is started again (a new pid), the workers re-attach (to the other
        # scheduler or to it) and the mesh serves again.
        port = mesh.scheduler_with_workers()
        assert port in (mesh.ports["MESH_SCHEDULER_PORT"], mesh.ports["MESH_SCHEDULER2_PORT"])
        killed = mesh.service_pid("services.scheduler", port)
        os.kill(killed, signal.SIGKILL)
        wait_until(lambda: _restarted(mesh, port, killed), READY_TIMEOUT_S, interval_s=0.2,
                   message=f"scheduler on {port} started again")
        gateway = mesh.address("MESH_GATEWAY_PORT")
        wait_until(lambda: {"toy-classifier", "toy-generator"} <= ready_models(gateway, API_KEY, credentials=TLS),
                   READY_TIMEOUT_S, interval_s=0.2, message="both models ready again")
        wait_until(lambda: _serves(serve_one_of_each), READY_TIMEOUT_S, interval_s=0.2, message="served again")
        assert serve_one_of_each() == ("bright", 8)
        assert mesh.honcho.poll() is None, mesh.log_tail()
        assert "TLS is OFF" not in mesh.log_path.read_text(errors="replace")

    started = mesh.started()
    assert len(started) >= 6
    mesh.honcho.send_signal(signal.SIGTERM)
    mesh.honcho.wait(timeout=30)
    _, alive = psutil.wait_procs(started, timeout=15)
    assert not alive, f"left running after honcho stopped: {[p.pid for p in alive]}"
    assert not any(is_serving(address, credentials=TLS) for address in health)


def _restarted(mesh: LocalMesh, port: int, old_pid: int) -> bool:
    try:
        return mesh.service_pid("services.scheduler", port) != old_pid and is_serving(f"127.0.0.1:{port}", credentials=TLS)
    except AssertionError:
        return False  # between the old process and the new one


def _serves(serve_one_of_each) -> bool:
    try:
        return serve_one_of_each() == ("bright", 8)
    except grpc.RpcError:
        return False
