"""A scheduler with mTLS on: who may call what, and every bad handshake answered cleanly.

After each case the scheduler still answers health SERVING to a good client.
"""

from __future__ import annotations

import os
import queue
import socket

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.tls_fixtures import DevPki, tls_health, wait_tls_serving
from tools.testbed.processes import SERVING, ServiceProcess, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> DevPki:
    return DevPki.create(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def scheduler(pki, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-scheduler")
    process = ServiceProcess("scheduler", "scheduler", free_port(), pki.files["scheduler"].server_args(), {},
                             tmp / "scheduler.log", tls=False)
    process.start()
    try:
        wait_tls_serving(process, pki.client("gateway"))
        yield process
    finally:
        process.stop()


@pytest.fixture(autouse=True)
def still_serving_afterwards(request, pki):
    yield
    if "scheduler" in request.fixturenames:
        process = request.getfixturevalue("scheduler")
        assert process.alive(), process.log_tail()
        assert tls_health(process.address, pki.client("gateway")) == SERVING, process.log_tail()


def _stub(address: str, credentials: grpc.ChannelCredentials):
    channel = grpc.secure_channel(address, credentials)
    return channel, scheduler_pb2_grpc.SchedulerStub(channel)


def test_the_log_says_tls_is_on_with_identities(scheduler):
    assert "TLS on (client certificates required; identity per method)" in scheduler.log_tail(200)
    assert "TLS is OFF" not in scheduler.log_tail(200)


def test_a_gateway_identity_may_list_models(scheduler, pki):
    channel, stub = _stub(scheduler.address, pki.client("gateway"))
    with channel:
        reply = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
    assert isinstance(reply, gateway_pb2.ListModelsResponse)


def test_a_worker_identity_calling_classify_is_permission_denied(scheduler, pki):
    channel, stub = _stub(scheduler.address, pki.client("worker"))
    request = scheduler_pb2.ScheduleClassifyRequest(
        request=gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="digits")))
    with channel, pytest.raises(grpc.RpcError) as caught:
        stub.Classify(request, timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert caught.value.details() == ("peer spiffe://infermesh/worker may not call /infermesh.v1.Scheduler/Classify: "
                                      "only a gateway identity (spiffe://infermesh/gateway) may")


def test_a_gateway_identity_calling_attach_is_permission_denied(scheduler, pki):
    channel, stub = _stub(scheduler.address, pki.client("gateway"))
    outbox: queue.Queue = queue.Queue()
    with channel, pytest.raises(grpc.RpcError) as caught:
        next(stub.Attach(iter(outbox.get, None), timeout=5))
    outbox.put(None)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "peer spiffe://infermesh/gateway may not call /infermesh.v1.Scheduler/Attach" in caught.value.details()


def test_a_worker_identity_may_open_attach(scheduler, pki):
    # Past the identity check the scheduler waits for the worker's hello; the deadline ends the call.
    channel, stub = _stub(scheduler.address, pki.client("worker"))
    outbox: queue.Queue = queue.Queue()
    with channel, pytest.raises(grpc.RpcError) as caught:
        next(stub.Attach(iter(outbox.get, None), timeout=1))
    outbox.put(None)
    assert caught.value.code() != grpc.StatusCode.PERMISSION_DENIED


def test_plaintext_to_the_tls_port_fails_cleanly(scheduler):
    with grpc.insecure_channel(scheduler.address) as channel, pytest.raises(grpc.RpcError) as caught:
        scheduler_pb2_grpc.SchedulerStub(channel).ListModels(gateway_pb2.ListModelsRequest(), timeout=3)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("case", ["rogue CA", "expired", "no client certificate"])
def test_bad_client_certificates_are_refused_at_the_handshake(scheduler, pki, case):
    cert = {"rogue CA": pki.rogue, "expired": pki.expired, "no client certificate": None}[case]
    channel, stub = _stub(scheduler.address, pki.client_with(cert))
    with channel, pytest.raises(grpc.RpcError) as caught:
        stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=3)
    # Refused before any method runs: no PERMISSION_DENIED from the interceptor, the connection never opens.
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("num_bytes", [1, 517, 64 * 1024])
def test_handshake_garbage_is_dropped(scheduler, num_bytes):
    host, port = scheduler.address.rsplit(":", 1)
    received = b""
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        try:
            # 0x16 0x03 0x01 makes the first bytes look like a TLS ClientHello record, the rest is noise.
            raw.sendall(b"\x16\x03\x01" + os.urandom(num_bytes))
            raw.shutdown(socket.SHUT_WR)
            while chunk := raw.recv(4096):
                received += chunk
        except OSError:
            pass  # the server reset the connection while we were still sending: the refusal we want
    assert len(received) < 64  # at most a TLS alert, never application data


def test_unreadable_certificate_files_stop_the_start_with_a_configuration_error(pki, tmp_path):
    args = ["--tls-cert-file", str(tmp_path / "missing.pem"), "--tls-key-file", str(tmp_path / "missing-key.pem"),
            "--tls-ca-file", str(pki.files["scheduler"].ca_path)]
    process = ServiceProcess("scheduler", "scheduler", free_port(), args, {}, tmp_path / "bad.log", tls=False).start()
    assert process.proc.wait(timeout=60) == 2
    assert f"scheduler: configuration error: cannot read the TLS certificate file {tmp_path}/missing.pem" in (
        process.log_tail())
