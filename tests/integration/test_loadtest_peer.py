"""The load test against a server that is not ours: Ray Serve serving our repository's tinylm (OpenAI
API) and digits (KServe v2 REST and gRPC) with `@serve.batch` (bench/harness/ray_serve_peer.py), in a test-only
venv (`ray[serve]` from PyPI, built in the background from the end of collection). Every request
succeeds, and the report marks the stages absent: the peer reports none. Then `ab` of one scenario,
the mesh's OpenAI front against the peer's, on tinylm both.

One Ray Serve peer and one mesh (scheduler, a tinylm worker, gateway) for the module, started side by
side; runs of 2 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest

from loadtest.cli import EXIT_OK, main
from loadtest.report_json import SCHEMA_PATH, load_report
from tests.support.side_venv import side_venv_python
from tools.testbed.processes import ROOT, free_port, running_mesh, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SIDE_VENV = ("rayserve", "ray[serve]==2.60.0", True)
PEER_START_S = 240  # Ray's cluster, Serve's controller and proxy, two replicas loading torch: ~45 s at load 11

TENANT = "tenants:\n  - {name: alpha, api_key: demo-key-alpha}\n"
GENERATE = """
  - {name: completions-stream, kind: generate, model: tinylm, deadline_ms: 20000, prompt_len: 8, output_len: 6}
  - {name: chat-stream, kind: generate, model: tinylm, deadline_ms: 20000, prompt_len: 8, output_len: 6, api: chat}
  - {name: completions-whole, kind: generate, model: tinylm, deadline_ms: 20000, prompt_len: 8, output_len: 6,
     stream: false}
  - {name: chat-whole, kind: generate, model: tinylm, deadline_ms: 20000, prompt_len: 8, output_len: 6, api: chat,
     stream: false}
"""
AB_GENERATE = """
  - {name: completions-stream, kind: generate, model: tinylm, deadline_ms: 20000, prompt_len: 8, output_len: 6}
"""
CLASSIFY = """
  - {name: classify-png, kind: classify, model: digits, share: 1, deadline_ms: 10000,
     image: {size_px: 28, channels: 1, encoding: png, num_variants: 4}}
  - {name: classify-raw, kind: classify, model: digits, share: 1, deadline_ms: 10000,
     image: {size_px: 40, channels: 3, encoding: raw, num_variants: 4}}
"""


def _scenario(name: str, classes: str, rate_rps: float = 12, duration_s: float = 2) -> str:
    return (f"name: {name}\nduration_s: {duration_s}\nwarmup_s: 0.5\nload: {{arrival: poisson, rate_rps: {rate_rps}}}\n"
            f"{TENANT}classes:{classes}")


@pytest.fixture(scope="module")
def started_peer(tmp_path_factory):
    """The Ray Serve peer's process, its log and port: started, not yet ready; shut down after the module."""
    python = side_venv_python(*SIDE_VENV)
    port, grpc_port = free_port(), free_port()
    # Ray keeps Unix sockets under its temp dir: a short path, or they pass the 107-byte limit.
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    log = tmp_path_factory.mktemp("ray-peer") / "peer.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([str(python), "-m", "bench.harness.ray_serve_peer", "--port", str(port),
                                    "--grpc-port", str(grpc_port), "--temp-dir", ray_dir], cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process, log, port, grpc_port
    finally:
        _stop(process)
        shutil.rmtree(ray_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, started_peer):
    """Started while the peer boots (each takes ~35 s on the loaded 2-core box)."""
    http_port = free_port()
    with running_mesh(tmp_path_factory.mktemp("peer-mesh"), tls=False) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("tinylm")
        mesh.start_gateway("--http-port", str(http_port))
        mesh.http_port = http_port
        yield mesh


@pytest.fixture(scope="module")
def peer(started_peer, mesh):
    """The ready Ray Serve peer's HTTP and gRPC ports (plaintext, 127.0.0.1)."""
    process, log, port, grpc_port = started_peer
    wait_until(lambda: process.poll() is not None or "READY" in log.read_text(errors="replace"),
               timeout_s=PEER_START_S, interval_s=0.2, message="the Ray Serve peer READY")
    if process.poll() is not None:
        pytest.fail(f"the Ray Serve peer exited {process.returncode}:\n{_tail(log)}")
    return Peer(f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", grpc_port)


@dataclass(frozen=True)
class Peer:
    http: str
    grpc: str
    grpc_port: int


def _listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                addresses.add(address)
    return addresses


def _stop(process: subprocess.Popen) -> None:
    """SIGKILL to every process of the peer's session (it was started in a session of its own): the peer
    and Ray's processes, whose workers and actors run in process groups of their own there. Not SIGTERM:
    the peer's serve.shutdown() and ray.shutdown() took 7-10 s of the module's teardown, for nothing the
    tests look at, and nothing of the peer's outlives its processes and its temp dir (removed after)."""
    for _ in range(10):  # a process Ray started while the others were being killed: killed the next round
        members = _session_members(process.pid)
        if not members:
            break
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # ended meanwhile
    process.wait(timeout=10)


def _session_members(session_id: int) -> list[int]:
    """The live processes (not zombies) in the session `session_id`, from /proc/<pid>/stat."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session
        except (OSError, IndexError):
            continue  # ended meanwhile
        if fields[0] != "Z" and int(fields[3]) == session_id:
            members.append(int(stat.parent.name))
    return members


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-30:])


def _run(tmp_path, capsys, name: str, classes: str, target: str) -> dict:
    scenario = tmp_path / f"{name}.yaml"
    scenario.write_text(_scenario(name, classes))
    code = main(["run", str(scenario), "--target", target, "--out", str(tmp_path), "--no-progress",
                 "--wait-ready-s", "20"])
    assert code == EXIT_OK, capsys.readouterr()
    (path,) = tmp_path.glob(f"{name}-*.json")
    doc = load_report(path)
    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()), cls=jsonschema.Draft202012Validator)
    return doc


def _all_ok(doc: dict, min_requests: int = 8) -> dict:
    overall = doc["overall"]
    assert overall["num_requests"] >= min_requests
    assert overall["num_errors"] == 0, overall["error_examples"]
    return overall


def test_openai_target_streams_and_waits_on_ray_serve_and_marks_its_stages_absent(peer, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "peer-openai", GENERATE, f"openai+http://{peer.http}/v1")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "openai+http" and doc["meta"]["stages_reported"] is False
    assert set(overall["stages"]) <= {"client_queue", "other"}  # no server stage is made up
    for name in ("completions-stream", "chat-stream", "completions-whole", "chat-whole"):
        group = doc["classes"][name]
        assert group["num_ok"] > 0, name
        assert group["stream"]["mean_output_tokens"] == 6, name  # the peer's usage
    assert doc["classes"]["completions-stream"]["stream"]["itl_ms"]["count"] > 0


def test_kserve_http_target_infers_on_ray_serve(peer, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "peer-kserve", CLASSIFY, f"kserve+http://{peer.http}")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "kserve+http" and doc["meta"]["stages_reported"] is False
    assert set(overall["stages"]) <= {"client_queue", "other"}
    assert doc["classes"]["classify-png"]["num_ok"] > 0 and doc["classes"]["classify-raw"]["num_ok"] > 0


def test_kserve_grpc_target_infers_on_ray_serves_grpc_proxy_bound_to_loopback(peer, tmp_path, capsys):
    doc = _run(tmp_path, capsys, "peer-kserve-grpc", CLASSIFY, f"kserve+grpc://{peer.grpc}")
    overall = _all_ok(doc)
    assert doc["meta"]["target_kind"] == "kserve+grpc" and doc["meta"]["stages_reported"] is False
    assert set(overall["stages"]) <= {"client_queue", "other"}
    # Ray's gRPC proxy binds [::] unless the peer's hook moves it to loopback (IPv4-mapped in tcp6).
    addresses = _listening_addresses(peer.grpc_port)
    assert addresses and addresses <= {"0100007F", "0000000000000000FFFF00000100007F"}, addresses


def test_ab_sets_the_mesh_and_ray_serve_side_by_side_on_one_scenario(mesh, peer, tmp_path, capsys):
    scenario = tmp_path / "mesh-vs-ray.yaml"
    scenario.write_text(_scenario("mesh-vs-ray", AB_GENERATE, rate_rps=6, duration_s=1.5))
    code = main(["ab", str(scenario), "--target", f"openai+http://127.0.0.1:{mesh.http_port}/v1",
                 "--target", f"openai+http://{peer.http}/v1", "--slice-s", "0.5", "--out", str(tmp_path), "--no-progress",
                 "--wait-ready-s", "30"])
    assert code == EXIT_OK, capsys.readouterr()
    doc = json.loads(next(tmp_path.glob("ab-mesh-vs-ray-*.json")).read_text())
    for side in ("a", "b"):
        _all_ok(doc[side], min_requests=4)
        assert doc[side]["classes"]["completions-stream"]["stream"]["mean_output_tokens"] == 6
    # The mesh reports its stages; the peer does not, and its report says so rather than inventing them.
    assert doc["a"]["meta"]["stages_reported"] is True and doc["b"]["meta"]["stages_reported"] is False
    metrics = {(c["group"], c["metric"]) for c in doc["comparison"]}
    assert {("overall", "p99"), ("class:completions-stream", "ttft_p50")} <= metrics
