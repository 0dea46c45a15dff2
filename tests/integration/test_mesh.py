"""The walking skeleton end to end: real processes, all three hops."""

from __future__ import annotations

import json
import signal
import threading

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.processes import NOT_SERVING, SERVING, health_status, running_mesh, wait_until

pytestmark = pytest.mark.integration

CLASSIFIER = common_pb2.ModelRef(name="toy-classifier")
GENERATOR = common_pb2.ModelRef(name="toy-generator")
BRIGHT = common_pb2.Image(raw=common_pb2.RawImage(pixels=bytes([250] * 12), height=2, width=2, channels=3))


def _services_in(timings: common_pb2.Timings) -> set[str]:
    return {stage.service for stage in timings.stages}


def _stages_in(timings: common_pb2.Timings) -> set[str]:
    return {common_pb2.Stage.Name(stage.stage) for stage in timings.stages}


def test_classify_and_generate_flow_through_gateway_scheduler_and_worker(gateway_stub):
    reply = gateway_stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT, top_k=2), timeout=10)
    assert [label.label for label in reply.labels] == ["bright", "dark"]
    assert reply.model.version == "1"
    assert _services_in(reply.timings) == {"gateway", "scheduler", "worker"}
    assert {"STAGE_QUEUE_WAIT", "STAGE_BATCH_WAIT", "STAGE_COMPUTE", "STAGE_ADMISSION"} <= _stages_in(reply.timings)

    chunks = list(gateway_stub.Generate(
        gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc", sampling=common_pb2.SamplingParams(max_tokens=5)),
        timeout=10,
    ))
    assert "".join(chunk.text for chunk in chunks) == "defgh"
    assert [chunk.index for chunk in chunks] == [0, 1, 2, 3, 4]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 5)
    assert {"gateway", "scheduler", "worker"} <= _services_in(last.timings)
    assert last.ttft_us > 0


def test_a_token_id_prompt_is_generated_from_as_its_text_is(gateway_stub):
    """prompt_token_ids are used as they are: the toy's ids are its bytes, so [97, 98, 99] is "abc"."""
    sampling = common_pb2.SamplingParams(max_tokens=5, prompt_logprobs=0)
    by_text, by_ids = (list(gateway_stub.Generate(gateway_pb2.GenerateRequest(model=GENERATOR, **prompt,
                                                                              sampling=sampling), timeout=10))
                       for prompt in ({"prompt": "abc"}, {"prompt_token_ids": [97, 98, 99]}))
    assert "".join(c.text for c in by_ids) == "".join(c.text for c in by_text) == "defgh"
    assert [p.token.token_id for p in by_ids[0].prompt_logprobs] == [97, 98, 99]
    assert b"".join(p.token.token_bytes for p in by_ids[0].prompt_logprobs) == b"abc"
    assert (by_ids[-1].usage.prompt_tokens, by_ids[-1].usage.completion_tokens) == (3, 5)


def test_one_request_gives_one_trace_with_spans_from_all_three_services(tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    with running_mesh(tmp_path, env={"INFERMESH_TRACE_FILE": str(trace_file)}) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-classifier")
        mesh.start_gateway()
        with session_tls.channel(mesh.gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=10)

        def spans():
            if not trace_file.exists():
                return []
            return [json.loads(line) for line in trace_file.read_text().splitlines()]

        def root_trace():
            roots = [s for s in spans() if s["name"] == "infermesh.v1.Inference/Classify"]
            return roots[0]["trace_id"] if roots else None

        expected = {"infermesh.v1.Inference/Classify", "admission", "infermesh.v1.Scheduler/Classify", "queue_wait",
                    "batch_wait", "worker.execute_batch", "compute"}

        def names_in_trace():
            trace_id = root_trace()
            return {s["name"] for s in spans() if s["trace_id"] == trace_id} if trace_id else set()

        # A span is written when it ends, a parent after its children (compute before worker.execute_batch), and
        # each service's exporter on its own schedule: wait for the whole set, not the first worker span.
        wait_until(lambda: expected <= names_in_trace(), timeout_s=10,
                   message=f"all of {sorted(expected)} in the trace")
        trace_id = root_trace()
        in_trace = [s for s in spans() if s["trace_id"] == trace_id]
        assert {s["service"] for s in in_trace} == {"gateway", "scheduler", "worker"}
        # OpenTelemetry RPC conventions: full method as the name, rpc.* attributes, integer status code.
        for name, service in (("infermesh.v1.Inference/Classify", "infermesh.v1.Inference"),
                              ("infermesh.v1.Scheduler/Classify", "infermesh.v1.Scheduler")):
            (span,) = [s for s in in_trace if s["name"] == name]
            attributes = span["attributes"]
            assert (attributes["rpc.system"], attributes["rpc.service"], attributes["rpc.method"]) == (
                "grpc", service, "Classify")
            assert attributes["rpc.grpc.status_code"] == 0
        ids = {s["span_id"] for s in in_trace}
        orphans = [s["name"] for s in in_trace if s["parent_id"] and s["parent_id"] not in ids]
        assert orphans == [], "every span's parent is in the same trace"


def test_health_is_serving_after_start_and_not_serving_while_draining(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        worker = mesh.start_worker("toy-classifier", "--toy-compute-ms", "1500", "--drain-grace-s", "10")
        mesh.start_gateway()
        assert health_status(worker.address) == SERVING
        outcome = {}

        def slow_request():
            with session_tls.channel(mesh.gateway.address) as channel:
                stub = gateway_pb2_grpc.InferenceStub(channel)
                outcome["reply"] = stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=20)

        thread = threading.Thread(target=slow_request)
        thread.start()
        threading.Event().wait(0.5)  # the request is now running on the worker (1.5 s of compute)
        worker.signal(signal.SIGTERM)
        wait_until(lambda: health_status(worker.address) in (NOT_SERVING, None), timeout_s=5,
                   message="worker NOT_SERVING on drain")
        assert worker.alive(), "worker keeps running while it finishes in-flight work"
        thread.join(timeout=20)
        assert outcome["reply"].labels[0].label == "bright", "in-flight request finished during drain"
        assert worker.proc.wait(timeout=15) == 0


def test_killed_worker_is_replaced_by_a_new_one_and_the_mesh_answers_again(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        first = mesh.start_worker("toy-classifier")
        mesh.start_gateway()
        with session_tls.channel(mesh.gateway.address) as channel:
            stub = gateway_pb2_grpc.InferenceStub(channel)
            request = gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT)
            assert stub.Classify(request, timeout=10).labels[0].label == "bright"
            first.signal(signal.SIGKILL)
            first.proc.wait(timeout=5)

            def unavailable():
                try:
                    stub.Classify(request, timeout=5)
                except grpc.RpcError as exc:
                    return exc.code() == grpc.StatusCode.UNAVAILABLE
                return False

            wait_until(unavailable, timeout_s=10, message="scheduler notices the dead worker")
            mesh.start_worker("toy-classifier", name="replacement")
            wait_until(lambda: _answers(stub, request), timeout_s=10, message="replacement answers")


def _answers(stub, request) -> bool:
    try:
        return stub.Classify(request, timeout=5).labels[0].label == "bright"
    except grpc.RpcError:
        return False


def test_work_on_a_killed_worker_is_redispatched_to_another(tmp_path):
    with running_mesh(tmp_path) as mesh:
        mesh.start_scheduler()
        slow = mesh.start_worker("toy-classifier", "--toy-compute-ms", "3000", name="slow")
        mesh.start_gateway()
        outcome = {}

        def request():
            with session_tls.channel(mesh.gateway.address) as channel:
                stub = gateway_pb2_grpc.InferenceStub(channel)
                outcome["reply"] = stub.Classify(gateway_pb2.ClassifyRequest(model=CLASSIFIER, image=BRIGHT), timeout=20)

        thread = threading.Thread(target=request)
        thread.start()
        threading.Event().wait(1.0)  # dispatched to the only worker, which is computing
        mesh.start_worker("toy-classifier", name="fast")
        slow.signal(signal.SIGKILL)
        thread.join(timeout=20)
        assert outcome["reply"].labels[0].label == "bright"
