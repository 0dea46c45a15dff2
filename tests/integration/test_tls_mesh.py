"""The whole mesh with TLS: workers attach over mTLS with worker certificates, the gateway calls
the scheduler over mTLS with its own, and a tenant without a certificate gets answers over TLS."""

from __future__ import annotations

import time

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.tls_fixtures import DevPki, wait_tls_serving
from tools.testbed.processes import ServiceProcess, free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tls-mesh")
    pki = DevPki.create(tmp / "pki")
    processes: list[ServiceProcess] = []

    def spawn(name: str, service: str, args: list[str]) -> ServiceProcess:
        process = ServiceProcess(name, service, free_port(), args, {}, tmp / f"{name}.log", tls=False)
        processes.append(process)
        return process.start()

    try:
        scheduler = spawn("scheduler", "scheduler", pki.files["scheduler"].server_args())
        wait_tls_serving(scheduler, pki.client("gateway"))
        for model in ("toy-classifier", "toy-generator"):
            worker = spawn(model, "worker", [
                "--scheduler-address", scheduler.address, "--model-name", model,
                "--reconnect-initial-s", "0.05", "--reconnect-max-s", "0.5", *pki.files["worker"].server_args()])
            wait_tls_serving(worker, pki.client("gateway"))
        gateway = spawn("gateway", "gateway",
                        ["--scheduler-address", scheduler.address, *pki.files["gateway"].server_args()])
        wait_tls_serving(gateway, pki.client_with(None))
        yield {"pki": pki, "gateway": gateway, "scheduler": scheduler, "processes": processes}
    finally:
        for process in reversed(processes):
            process.stop()


def test_classify_and_generate_through_a_mesh_with_mtls_on_every_internal_hop(mesh):
    pki, gateway = mesh["pki"], mesh["gateway"]
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3))
    with grpc.secure_channel(gateway.address, pki.client_with(None)) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        for _ in range(3):
            reply = stub.Classify(gateway_pb2.ClassifyRequest(
                model=common_pb2.ModelRef(name="toy-classifier"), image=image), timeout=30, wait_for_ready=True)
            assert reply.labels
            chunks = list(stub.Generate(gateway_pb2.GenerateRequest(
                model=common_pb2.ModelRef(name="toy-generator"), prompt="ab",
                sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=30))
            assert 0 < sum(len(c.token_ids) for c in chunks) <= 4 and chunks[-1].finish_reason
    scheduler_log = mesh["scheduler"].log_tail(400)
    assert "refused" not in scheduler_log
    for process in mesh["processes"]:
        assert "TLS is OFF" not in process.log_tail(400), process.name


def test_a_process_with_the_gateways_certificate_cannot_attach_as_a_worker(mesh, tmp_path):
    pki, scheduler = mesh["pki"], mesh["scheduler"]
    impostor = ServiceProcess("impostor", "worker", free_port(), [
        "--scheduler-address", scheduler.address, "--model-name", "toy-classifier",
        "--reconnect-initial-s", "0.05", "--reconnect-max-s", "0.5",
        *pki.files["gateway"].server_args()], {}, tmp_path / "impostor.log", tls=False)
    impostor.start()
    try:
        give_up = time.monotonic() + 60
        while "may not call /infermesh.v1.Scheduler/Attach" not in impostor.log_tail(200):
            assert time.monotonic() < give_up, impostor.log_tail()
            assert impostor.alive(), impostor.log_tail()
            time.sleep(0.1)
    finally:
        impostor.stop()
    assert "refused /infermesh.v1.Scheduler/Attach" in scheduler.log_tail(400)
    assert "spiffe://infermesh/gateway" in scheduler.log_tail(400)
