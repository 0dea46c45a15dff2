"""A reflection-driven fuzz of every method on every gRPC port of a small mesh (issue 13, "Bad input").

One mesh (scheduler, a toy classifier and a toy generator worker, a gateway with a tenants file;
mTLS inside, server TLS at the gateway) takes, per port, at least 1000 hostile calls built from
what the port's reflection lists (tests/fuzz/grpc_fuzz.py). The scheduler's port is fuzzed twice:
as the gateway's identity and as a worker's. No call may end UNKNOWN or INTERNAL, no listed method
UNIMPLEMENTED; afterwards every process is alive and SERVING and normal requests are answered.

The seed is printed; INFERMESH_FUZZ_SEED=<seed> replays the same calls, INFERMESH_FUZZ_CALLS=<n>
sends n per port.
"""

from __future__ import annotations

import os
import random

import pytest

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.worker.builtin_models import ToyClassifierRuntime, ToyGeneratorRuntime
from tests.fuzz.grpc_fuzz import FuzzPlan, discover, fuzz_port
from tools.testbed.gateway_fixtures import bearer, tenant, write_tenants
from tools.testbed.processes import SERVING, Mesh, health_status, running_mesh, wait_until

pytestmark = pytest.mark.integration

API_KEY = "fuzz-key"
ADMIN_KEY = "fuzz-admin-key"  # a tenant with admin: true, so the gateway's Admin/GetStatus answers it
NUM_CALLS = int(os.environ.get("INFERMESH_FUZZ_CALLS", "1000"))
SEED = int(os.environ.get("INFERMESH_FUZZ_SEED", str(random.SystemRandom().randrange(2**32))))
FORBIDDEN = ("UNKNOWN", "INTERNAL", "UNIMPLEMENTED")
HOSTILE_METADATA = (
    ("traceparent", "00-zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz-0000000000000000-ff"),
    ("x-request-start", "-1e309"),
    ("grpc-retry-pushback-ms", "NaN"),
)
METADATA = (
    bearer(API_KEY), bearer(API_KEY), bearer(API_KEY), bearer(ADMIN_KEY), (), bearer("not-a-key"),
    (("authorization", "Basic eA=="),),
    (*bearer(API_KEY), *HOSTILE_METADATA), HOSTILE_METADATA, (("authorization", "Bearer " + "k" * 4000),),
)


IMAGE = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))
CLASSIFY = gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="toy-classifier"), image=IMAGE, top_k=2)
GENERATE = gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="toy-generator"), prompt="ab",
                                       sampling=common_pb2.SamplingParams(max_tokens=4))
TOKENIZE = gateway_pb2.TokenizeRequest(model=common_pb2.ModelRef(name="toy-generator"), prompt="ab")
DETOKENIZE = gateway_pb2.DetokenizeRequest(model=common_pb2.ModelRef(name="toy-generator"), token_ids=[97, 98])
TENANT = scheduler_pb2.TenantContext(tenant_id="fuzzer", priority=common_pb2.PRIORITY_STANDARD, weight=1)
INFER = kserve.ModelInferRequest(model_name="toy-classifier", inputs=[kserve.ModelInferRequest.InferInputTensor(
    name="IMAGE", datatype="UINT8", shape=[2, 2, 3])], raw_input_contents=[bytes(12)])
# Valid requests the fuzzer starts some calls from; a hello lets a fake worker attach (next to the
# real ones, for the same models) so the hostile results that follow reach the scheduler's pools.
SEEDS = {
    "/infermesh.v1.Inference/Classify": [CLASSIFY.SerializeToString()],
    "/infermesh.v1.Inference/Generate": [GENERATE.SerializeToString()],
    "/inference.GRPCInferenceService/ModelInfer": [INFER.SerializeToString()],
    "/infermesh.v1.Inference/Tokenize": [TOKENIZE.SerializeToString()],
    "/infermesh.v1.Inference/Detokenize": [DETOKENIZE.SerializeToString()],
    "/infermesh.v1.Scheduler/Tokenize": [TOKENIZE.SerializeToString()],
    "/infermesh.v1.Scheduler/Detokenize": [DETOKENIZE.SerializeToString()],
    "/infermesh.v1.Scheduler/Classify": [
        scheduler_pb2.ScheduleClassifyRequest(request=CLASSIFY, tenant=TENANT).SerializeToString()],
    "/infermesh.v1.Scheduler/Generate": [
        scheduler_pb2.ScheduleGenerateRequest(request=GENERATE, tenant=TENANT).SerializeToString()],
    "/infermesh.v1.Scheduler/Attach": [
        scheduler_pb2.WorkerMessage(hello=ToyClassifierRuntime("1").hello("fuzz-classifier")).SerializeToString(),
        scheduler_pb2.WorkerMessage(hello=ToyGeneratorRuntime("1").hello("fuzz-generator")).SerializeToString(),
    ],
}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> Mesh:
    tmp = tmp_path_factory.mktemp("fuzz-mesh")
    tenants = write_tenants(tmp / "tenants.yaml", [tenant("fuzzer", API_KEY), {**tenant("ops", ADMIN_KEY), "admin": True}])
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        mesh.start_gateway("--tenants-file", str(tenants))
        yield mesh


def _port(mesh: Mesh, name: str):
    """(process, the client identity it is called with: a certificate's service or None for none)."""
    workers = [p for p in mesh.processes if p.service == "worker"]
    return {
        "gateway": (mesh.gateway, None),
        "scheduler-as-gateway": (mesh.scheduler, "gateway"),
        "scheduler-as-worker": (mesh.scheduler, "worker"),
        "worker-classifier": (workers[0], "gateway"),
        "worker-generator": (workers[1], "gateway"),
    }[name]


@pytest.mark.parametrize("port", ["gateway", "scheduler-as-gateway", "scheduler-as-worker",
                                  "worker-classifier", "worker-generator"])
async def test_hostile_calls_get_clean_statuses_and_every_process_keeps_serving(mesh, port):
    process, identity = _port(mesh, port)
    with process.channel(identity) as channel:
        methods = discover(channel)
    assert any(m.path.startswith("/grpc.health.v1.Health/") for m in methods), [m.path for m in methods]
    seed = SEED + sum(map(ord, port))
    print(f"\nfuzz {port}: seed {seed} (INFERMESH_FUZZ_SEED={SEED}), {NUM_CALLS} calls over {len(methods)} methods")
    plan = FuzzPlan(NUM_CALLS, seed, metadata_choices=METADATA, seeds=SEEDS)
    with process.channel(identity) as blocking:
        async with process.aio_channel(identity) as channel:
            outcome = await fuzz_port(channel, blocking, methods, plan)
    print(outcome.table())
    print(f"{port}: {outcome.num_calls} calls, {dict(outcome.histogram())}")

    assert outcome.num_calls >= NUM_CALLS
    bad = outcome.bad(FORBIDDEN)
    assert not bad, f"seed {SEED}: " + "\n".join(f"{m} {code}: {example}" for (m, code), example in bad.items())
    _assert_mesh_healthy(mesh)


def _fake_workers_gone(mesh: Mesh) -> bool:
    """Only the two real workers attached: a fake one the fuzz attached may outlive its call briefly
    (the client sees its deadline before the scheduler has run the stream's cleanup)."""
    with mesh.scheduler.channel("gateway") as channel:
        pressure = scheduler_pb2_grpc.SchedulerStub(channel).GetPressure(scheduler_pb2.GetPressureRequest(), timeout=5)
    attached = {(m.model.name, m.model.version): m.num_workers for m in pressure.models if m.num_workers}
    return attached == {("toy-classifier", "1"): 1, ("toy-generator", "1"): 1}


def _assert_mesh_healthy(mesh: Mesh) -> None:
    wait_until(lambda: _fake_workers_gone(mesh), timeout_s=15, message="only the real workers attached")
    for process in mesh.processes:
        assert process.alive(), process.log_tail()
        assert health_status(process.address) == SERVING, process.name
    with mesh.gateway.channel(None) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        assert stub.Classify(CLASSIFY, timeout=20, metadata=bearer(API_KEY)).labels
        chunks = list(stub.Generate(GENERATE, timeout=20, metadata=bearer(API_KEY)))
        assert sum(len(c.token_ids) for c in chunks) == 4
