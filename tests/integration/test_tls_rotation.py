"""Certificate rotation on a running scheduler: new connections see the new certificate,
an established stream keeps flowing, and a half-written rotation is not taken."""

from __future__ import annotations

import queue
import ssl
import time

import grpc
import pytest
from cryptography import x509
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.tls_fixtures import DevPki, served_certificate, tls_health, wait_tls_serving
from tools.testbed.processes import SERVING, ServiceProcess, free_port, wait_until

pytestmark = pytest.mark.integration


def _wait_for_serial(address, pki, folder, serial: int, timeout_s: float = 15.0):
    # The scheduler looks at its files at most once a second, on a handshake; poll with fresh handshakes.
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if served_certificate(address, pki.ca.issue_service("gateway"), pki.ca.cert_pem, folder).serial_number == serial:
            return
        time.sleep(0.2)
    raise TimeoutError(f"the scheduler did not present certificate serial {serial} within {timeout_s}s")


def _metrics_serial(port: int) -> int:
    """The serial of the certificate /metrics presents to a new connection."""
    pem = ssl.get_server_certificate(("127.0.0.1", port), timeout=5)
    return x509.load_pem_x509_certificate(pem.encode()).serial_number


def test_rotated_files_reach_new_connections_while_an_open_stream_keeps_flowing(tmp_path):
    """On the gRPC port and on HTTPS /metrics alike."""
    pki = DevPki.create(tmp_path / "pki")
    files = pki.files["scheduler"]
    metrics_port = free_port()
    process = ServiceProcess("scheduler", "scheduler", free_port(),
                             [*files.server_args(), "--metrics-port", str(metrics_port), "--metrics-tls", "true"],
                             {}, tmp_path / "s.log", tls=False)
    process.start()
    try:
        wait_tls_serving(process, pki.client("gateway"))
        first = served_certificate(process.address, pki.ca.issue_service("gateway"), pki.ca.cert_pem, tmp_path)
        assert _metrics_serial(metrics_port) == first.serial_number

        # A bidi stream (server reflection: one answer per question) opened before the rotation.
        channel = grpc.secure_channel(process.address, pki.client("worker"))
        questions: queue.Queue = queue.Queue()
        answers = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(questions.get, None), timeout=60)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        questions.put(ask)
        assert "infermesh.v1.Scheduler" in {s.name for s in next(answers).list_services_response.service}

        rotated = pki.ca.issue_service("scheduler")
        rotated.write(files.cert_path, files.key_path)
        new_serial = x509.load_pem_x509_certificate(rotated.cert_pem).serial_number
        assert new_serial != first.serial_number
        _wait_for_serial(process.address, pki, tmp_path, new_serial)
        wait_until(lambda: _metrics_serial(metrics_port) == new_serial, timeout_s=15,
                   message="/metrics presents the rotated certificate")

        questions.put(ask)
        assert "infermesh.v1.Scheduler" in {s.name for s in next(answers).list_services_response.service}
        questions.put(None)
        channel.close()
        assert tls_health(process.address, pki.client("gateway")) == SERVING
        assert "TLS certificate reloaded" in process.log_tail(200)
        assert "/metrics certificate reloaded" in process.log_tail(200)
    finally:
        process.stop()


def test_a_certificate_without_its_key_is_not_taken(tmp_path):
    pki = DevPki.create(tmp_path / "pki")
    files = pki.files["scheduler"]
    process = ServiceProcess("scheduler", "scheduler", free_port(), files.server_args(), {}, tmp_path / "s.log", tls=False)
    process.start()
    try:
        wait_tls_serving(process, pki.client("gateway"))
        before = served_certificate(process.address, pki.ca.issue_service("gateway"), pki.ca.cert_pem, tmp_path)
        files.cert_path.write_bytes(pki.ca.issue_service("scheduler").cert_pem)  # its key never arrives

        give_up = time.monotonic() + 15
        while "not usable yet" not in process.log_tail(200):
            assert time.monotonic() < give_up, process.log_tail()
            assert tls_health(process.address, pki.client("gateway")) == SERVING
            time.sleep(0.2)
        after = served_certificate(process.address, pki.ca.issue_service("gateway"), pki.ca.cert_pem, tmp_path)
        assert after.serial_number == before.serial_number
    finally:
        process.stop()
