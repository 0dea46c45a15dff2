"""A malformed worker on the Attach stream gets a precise status; the scheduler keeps serving."""

from __future__ import annotations

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.worker.builtin_models import ToyGeneratorRuntime
from tools.testbed import session_tls
from tools.testbed.processes import SERVING, health_status, wait_until

pytestmark = pytest.mark.integration

GOOD_CAPACITY = scheduler_pb2.WorkerCapacity(num_kv_blocks=8, block_size=16, max_seq_len=64)


def _attach(address: str, *messages: scheduler_pb2.WorkerMessage) -> grpc.RpcError | scheduler_pb2.SchedulerCommand:
    with session_tls.channel(address, identity="worker") as channel:  # only a worker may Attach
        replies = scheduler_pb2_grpc.SchedulerStub(channel).Attach(iter(messages), timeout=5)
        try:
            return next(replies)
        except grpc.RpcError as exc:
            return exc


def _hello(**fields) -> scheduler_pb2.WorkerMessage:
    base = dict(worker_id="w", model=common_pb2.ModelRef(name="m", version="1"),
                kind=common_pb2.MODEL_KIND_GENERATOR, capacity=GOOD_CAPACITY, protocol_version=1)
    return scheduler_pb2.WorkerMessage(hello=scheduler_pb2.WorkerHello(**{**base, **fields}))


@pytest.mark.parametrize(
    ("first_message", "message"),
    [
        (scheduler_pb2.WorkerMessage(heartbeat=scheduler_pb2.Heartbeat()), "the first Attach message must be hello"),
        (_hello(worker_id=""), "hello.worker_id is required"),
        (_hello(model=common_pb2.ModelRef(name="m")), "hello.model needs both name and version"),
        (_hello(kind=common_pb2.MODEL_KIND_UNSPECIFIED), "hello.kind is required"),
        (_hello(protocol_version=99), "worker speaks Attach protocol 99; this scheduler serves up to 2"),
        (_hello(capacity=scheduler_pb2.WorkerCapacity(block_size=16)),
         "a generator worker must declare num_kv_blocks and block_size >= 1"),
    ],
)
def test_bad_first_message_is_invalid_argument(toy_mesh, first_message, message):
    outcome = _attach(toy_mesh.scheduler.address, first_message)
    assert isinstance(outcome, grpc.RpcError)
    assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert outcome.details() == message


def test_worker_declaring_another_kind_for_an_attached_model_is_refused(toy_mesh):
    outcome = _attach(toy_mesh.scheduler.address,
                      _hello(model=common_pb2.ModelRef(name="toy-classifier", version="1")))
    assert isinstance(outcome, grpc.RpcError)
    assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "toy-classifier:1" in outcome.details()


def test_scheduler_keeps_serving_after_malformed_workers(toy_mesh, gateway_stub):
    _attach(toy_mesh.scheduler.address, scheduler_pb2.WorkerMessage())
    assert toy_mesh.scheduler.alive()
    assert health_status(toy_mesh.scheduler.address) == SERVING
    image = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes(12), height=2, width=2, channels=3))
    reply = gateway_stub.Classify(gateway_pb2.ClassifyRequest(model=common_pb2.ModelRef(name="toy-classifier"),
                                                              image=image), timeout=10)
    assert reply.labels[0].label == "dark"


def _num_workers(address: str, model: common_pb2.ModelRef) -> int:
    with session_tls.channel(address, identity="worker") as channel:
        reply = scheduler_pb2_grpc.SchedulerStub(channel).GetPressure(
            scheduler_pb2.GetPressureRequest(models=[model]), timeout=5)
    return sum(m.num_workers for m in reply.models)


def test_an_undecodable_message_after_the_hello_ends_the_attach_and_detaches_the_worker(toy_mesh):
    # Found by the reflection fuzz (tests/fuzz): the reader died on it and the worker stayed attached
    # as a ghost (15 of them after 600 hostile Attach calls), taking work it would never answer.
    address, model = toy_mesh.scheduler.address, common_pb2.ModelRef(name="toy-generator", version="1")
    num_real = _num_workers(address, model)
    hello = scheduler_pb2.WorkerMessage(hello=ToyGeneratorRuntime("1").hello("w-garbage"))
    with session_tls.channel(address, identity="worker") as channel:
        attach = channel.stream_stream("/infermesh.v1.Scheduler/Attach")
        call = attach(iter([hello.SerializeToString(), b"\xff\xff\xff"]), timeout=5)
        with pytest.raises(grpc.RpcError) as failure:
            list(call)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_until(lambda: _num_workers(address, model) == num_real, timeout_s=5, message="the worker detached")
