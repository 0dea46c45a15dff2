"""The gateway's Submit stream to the scheduler against its unary path, real processes.

Two gateways on one scheduler: `--upstream-mode unary` and `--upstream-mode stream`.
Whatever a client sees must not depend on which one it called: labels, token ids,
indexes, usage, and each failure's status and message.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import BRIGHT, CLASSIFIER, GENERATOR, restart_on_same_port, spawn_gateway
from tools.testbed.processes import running_mesh, wait_until
from tools.testbed.scheduler_fixtures import pressure_of, scheduler_stub, wait_for_idle_kv, wait_for_workers

pytestmark = pytest.mark.integration

# A paged generator with seeded sampling that needs no trained weights (a fresh clone has no model_repo/).
MOCK_GENERATOR = common_pb2.ModelRef(name="mock-generator")
DARK = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([5] * 12), height=2, width=2, channels=3))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(tmp_path_factory.mktemp("upstream-stream")) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator", "--toy-compute-ms", "10")
        mesh.start_worker("mock-generator")
        mesh.unary = spawn_gateway(mesh, "gateway-unary", "--upstream-mode", "unary")
        mesh.stream = spawn_gateway(mesh, "gateway-stream", "--upstream-mode", "stream")
        with scheduler_stub(mesh.scheduler.address) as stub:
            for model in (CLASSIFIER, GENERATOR, MOCK_GENERATOR):
                wait_for_workers(stub, model, 1)
        yield mesh


@pytest.fixture(scope="module")
def stubs(mesh):
    with session_tls.channel(mesh.unary.address) as unary, session_tls.channel(mesh.stream.address) as stream:
        yield {"unary": gateway_pb2_grpc.InferenceStub(unary), "stream": gateway_pb2_grpc.InferenceStub(stream)}


@pytest.fixture
def scheduler(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        yield stub


def _generate(stub, model, prompt: str, **sampling) -> list[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(model=model, prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))
    return list(stub.Generate(request, timeout=30))


def _essence(chunks: list[gateway_pb2.GenerateResponse]) -> tuple:
    last = chunks[-1]
    return ([list(c.token_ids) for c in chunks], [c.index for c in chunks], "".join(c.text for c in chunks),
            last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens)


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def test_classify_gives_the_same_labels_in_both_modes(stubs):
    for image in (BRIGHT, DARK):
        request = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=image, top_k=2)
        unary, stream = (stubs[mode].Classify(request, timeout=10) for mode in ("unary", "stream"))
        assert [(label.label, label.score) for label in stream.labels] == [
            (label.label, label.score) for label in unary.labels]
        assert {"gateway", "scheduler", "worker"} <= {stage.service for stage in stream.timings.stages}


@pytest.mark.parametrize("sampling", [
    {"max_tokens": 12},
    {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234},
], ids=["greedy", "seeded"])
def test_paged_generator_streams_the_same_tokens_indexes_and_usage_in_both_modes(stubs, sampling):
    unary = _generate(stubs["unary"], MOCK_GENERATOR, "The Python ", **sampling)
    stream = _generate(stubs["stream"], MOCK_GENERATOR, "The Python ", **sampling)
    assert _essence(stream) == _essence(unary)
    assert stream[-1].usage.completion_tokens == 12 or stream[-1].finish_reason == common_pb2.FINISH_REASON_EOS


def test_a_bad_request_fails_alone_while_the_others_on_the_stream_succeed(stubs):
    good = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT)
    bad = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT, top_k=5)
    stub = stubs["stream"]
    with ThreadPoolExecutor(max_workers=9) as pool:
        goods = [pool.submit(stub.Classify, good, timeout=10) for _ in range(8)]
        failed = pool.submit(_status, lambda: stub.Classify(bad, timeout=10))
        assert [future.result().labels[0].label for future in goods] == ["bright"] * 8
        assert failed.result() == _status(lambda: stubs["unary"].Classify(bad, timeout=10))
    assert failed.result()[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_unknown_model_fails_the_same_way_in_both_modes(stubs):
    missing = common_pb2.ModelRef(name="toy-generator", version="9")
    statuses = {mode: _status(lambda mode=mode: _generate(stubs[mode], missing, "abc", max_tokens=3))
                for mode in ("unary", "stream")}
    assert statuses["stream"] == statuses["unary"]


def test_cancelling_a_generate_frees_its_kv_blocks(stubs, scheduler):
    call = stubs["stream"].Generate(gateway_pb2.GenerateRequest(
        model=GENERATOR, prompt="abc", sampling=common_pb2.SamplingParams(max_tokens=400)), timeout=30)
    for _ in range(5):
        next(call)
    assert pressure_of(scheduler, GENERATOR).kv_usage > 0
    call.cancel()
    assert wait_for_idle_kv(scheduler, GENERATOR, timeout_s=3.0) < 2.0


def test_an_expired_deadline_gives_deadline_exceeded_and_frees_the_sequence(stubs, scheduler):
    request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc",
                                          sampling=common_pb2.SamplingParams(max_tokens=400))
    code, _ = _status(lambda: list(stubs["stream"].Generate(request, timeout=0.5)))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for_idle_kv(scheduler, GENERATOR, timeout_s=3.0)


def test_killing_the_scheduler_fails_calls_unavailable_and_the_gateway_serves_after_it_restarts(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-generator", "--toy-compute-ms", "10")
        # Nothing held (the hold would resume the stream once the scheduler is back): the failure is the subject.
        gateway = spawn_gateway(mesh, "gateway-stream", "--upstream-mode", "stream", "--retry-max-attempts", "1",
                                "--hold-max-calls", "0")
        with session_tls.channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc",
                                                  sampling=common_pb2.SamplingParams(max_tokens=400))
            call = stub.Generate(request, timeout=30)
            next(call)
            mesh.scheduler.signal(signal.SIGKILL)
            mesh.scheduler.proc.wait(timeout=5)
            with pytest.raises(grpc.RpcError) as caught:
                list(call)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

            restart_on_same_port(mesh, mesh.scheduler, "scheduler-restarted")
            short = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc",
                                                sampling=common_pb2.SamplingParams(max_tokens=3))

            def serves() -> bool:
                try:
                    return "".join(c.text for c in stub.Generate(short, timeout=5)) == "def"
                except grpc.RpcError:
                    return False

            wait_until(serves, timeout_s=20, message="the gateway serves again through a new stream")


def test_a_draining_scheduler_ends_the_gateways_stream_and_exits_without_waiting_out_its_grace(tmp_path):
    with running_mesh(tmp_path) as mesh:
        scheduler = mesh.start_scheduler("--drain-grace-s", "20")
        mesh.start_worker("toy-classifier")
        gateway = spawn_gateway(mesh, "gateway-stream", "--upstream-mode", "stream")
        with session_tls.channel(gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            request = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT)
            assert stub.Classify(request, timeout=10).labels[0].label == "bright"  # the stream is open
            began = time.monotonic()
            scheduler.signal(signal.SIGTERM)
            assert scheduler.proc.wait(timeout=25) == 0
            assert time.monotonic() - began < 5, "the Submit stream ended with its calls, not at the 20 s grace"
