"""Tenant config reloads on file change and on SIGHUP, under traffic that never sees an error;
a bad file is refused with a log line and the old config stays in force."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from infermesh.v1 import gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT, CLASSIFIER, bearer, spawn_gateway, tenant, write_tenants
from tools.testbed.processes import running_mesh, wait_until

pytestmark = pytest.mark.integration

ALICE, BOB, CAROL = "alice-key-123", "bob-key-456", "carol-key-789"


def _replace(path, tenants) -> None:
    """Write the new file beside the old and rename it over (how operators and ConfigMaps swap files)."""
    staged = path.with_suffix(".new")
    write_tenants(staged, tenants)
    os.replace(staged, path)


def _served(stub, key: str) -> bool:
    try:
        stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=5, metadata=bearer(key))
    except grpc.RpcError as exc:
        assert (exc.code(), exc.details()) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        return False
    return True


class SteadyTraffic:
    """Alice's requests, back to back, on every gateway while configs change underneath."""

    def __init__(self, stubs) -> None:
        self.errors: list[str] = []
        self.num_ok = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stubs,), daemon=True)
        self._thread.start()

    def _run(self, stubs) -> None:
        while not self._stop.is_set():
            for stub in stubs:
                try:
                    stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=5,
                                  metadata=bearer(ALICE))
                    self.num_ok += 1
                except grpc.RpcError as exc:
                    self.errors.append(f"{exc.code().name}: {exc.details()}")
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


BAD_FILE = "tenants:\n  - id: alice\n    priority: urgent\n"


def test_reload_on_change_and_sighup_keeps_traffic_and_refuses_bad_files(tmp_path):
    polled_file = write_tenants(tmp_path / "polled.yaml", [tenant("alice", ALICE)])
    signalled_file = write_tenants(tmp_path / "signalled.yaml", [tenant("alice", ALICE)])
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        polled = spawn_gateway(mesh, "gateway-polled", "--tenants-file", str(polled_file),
                               "--tenants-poll-interval-ms", "100")
        signalled = spawn_gateway(mesh, "gateway-signalled", "--tenants-file", str(signalled_file),
                                  "--tenants-poll-interval-ms", "0")
        with session_tls.channel(polled.address) as polled_channel, \
                session_tls.channel(signalled.address) as signalled_channel:
            polled_stub = gateway_pb2_grpc.InferenceStub(polled_channel)
            signalled_stub = gateway_pb2_grpc.InferenceStub(signalled_channel)
            traffic = SteadyTraffic([polled_stub, signalled_stub])
            try:
                # File change: picked up by the watcher's poll.
                assert not _served(polled_stub, BOB)
                _replace(polled_file, [tenant("alice", ALICE), tenant("bob", BOB)])
                wait_until(lambda: _served(polled_stub, BOB), timeout_s=10, message="bob admitted after the edit")

                polled_file.write_text(BAD_FILE, encoding="utf-8")
                wait_until(lambda: "refused tenant config" in polled.log_tail(200), timeout_s=10,
                           message="bad file refused")
                assert _served(polled_stub, BOB), "the old config stays in force"

                # SIGHUP: the only trigger on the gateway that does not poll.
                _replace(signalled_file, [tenant("alice", ALICE), tenant("carol", CAROL)])
                time.sleep(0.5)
                assert not _served(signalled_stub, CAROL), "not reloaded before the signal"
                signalled.signal(signal.SIGHUP)
                wait_until(lambda: _served(signalled_stub, CAROL), timeout_s=10, message="carol admitted after SIGHUP")

                signalled_file.write_text(BAD_FILE, encoding="utf-8")
                signalled.signal(signal.SIGHUP)
                wait_until(lambda: "refused tenant config" in signalled.log_tail(200), timeout_s=10,
                           message="bad file refused on SIGHUP")
                assert _served(signalled_stub, CAROL)
                assert signalled.alive() and polled.alive()
            finally:
                traffic.stop()
        refusal = next(line for line in polled.log_tail(200).splitlines() if "refused tenant config" in line)
        assert refusal.endswith(
            f"keeping the previous one (2 tenants): {polled_file}: tenant 'alice': field 'priority': "
            "must be one of critical, standard, sheddable, got 'urgent'"
        )
        assert "SIGHUP: reloading tenants" in signalled.log_tail(200)
    assert traffic.errors == []
    assert traffic.num_ok >= 20
