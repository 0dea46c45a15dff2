"""A rolling upgrade through a real scheduler process: workers older than the scheduler declare no
WorkerHello.features, and no grammar reaches one (it would return free text, or read a reasoning
model's JSON as reasoning). With a newer worker beside them, such a sequence goes to it; with none,
the request is refused UNAVAILABLE naming sampling.structured. A worker that masks by a grammar but
cannot wait for the think block gets the grammar over the whole output, and the first chunk says so
(grammar_after_reasoning false), so the gateway reads the output as answer, not reasoning.

The workers are scripted-HF workers of test_scheduler_hf_tokenizer (deepseek_r1, the think tags as
tokens of their own), declaring what each pretends to honour.
"""

from __future__ import annotations

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from services.common.reasoning_formats import DEEPSEEK_R1
from tests.integration.test_scheduler_hf_tokenizer import ScriptedHFWorker
from tests.unit.scheduler.hf_tokenizer_files import byte_level_json, with_added_tokens
from tools.testbed.processes import running_mesh
from tools.testbed.scheduler_fixtures import scheduler_stub, tenant, wait_for_workers

pytestmark = pytest.mark.integration

MIXED = common_pb2.ModelRef(name="r1-mixed", version="1")  # an older and a newer worker
OLD_ONLY = common_pb2.ModelRef(name="r1-old", version="1")  # older workers only
NO_WAIT = common_pb2.ModelRef(name="r1-no-wait", version="1")  # masks from the first token only
STRUCTURED = scheduler_pb2.WORKER_FEATURE_STRUCTURED_OUTPUT
NEWER = (STRUCTURED, scheduler_pb2.WORKER_FEATURE_GRAMMAR_AFTER_REASONING)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tokenizer_json = with_added_tokens(byte_level_json(), ("<think>", "</think>"))
    with running_mesh(tmp_path_factory.mktemp("scheduler-older-workers")) as mesh:
        mesh.start_scheduler()
        address = mesh.scheduler.address
        workers = {
            "mixed-old": ScriptedHFWorker(address, tokenizer_json, MIXED, worker_id="mixed-old",
                                          reasoning_parser=DEEPSEEK_R1),
            "mixed-new": ScriptedHFWorker(address, tokenizer_json, MIXED, worker_id="mixed-new", features=NEWER,
                                          reasoning_parser=DEEPSEEK_R1),
            "old": ScriptedHFWorker(address, tokenizer_json, OLD_ONLY, worker_id="old", reasoning_parser=DEEPSEEK_R1),
            "no-wait": ScriptedHFWorker(address, tokenizer_json, NO_WAIT, worker_id="no-wait", features=(STRUCTURED,),
                                        reasoning_parser=DEEPSEEK_R1),
        }
        try:
            with scheduler_stub(address) as stub:
                wait_for_workers(stub, MIXED, 2)
                wait_for_workers(stub, OLD_ONLY, 1)
                wait_for_workers(stub, NO_WAIT, 1)
            mesh.workers = workers
            yield mesh
        finally:
            for worker in workers.values():
                worker.close()


def first_chunk_of_constrained(stub, model: common_pb2.ModelRef, prompt: str) -> gateway_pb2.GenerateResponse:
    request = scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(model=model, prompt=prompt, sampling=common_pb2.SamplingParams(
            max_tokens=100, structured=common_pb2.StructuredOutput(regex=".*"))),
        tenant=tenant("tests"))
    chunks = [response.chunk for response in stub.Generate(request, timeout=10)]
    return chunks[0]


def test_a_grammar_waiting_for_the_reasoning_goes_only_to_the_newer_worker(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        for n in range(6):
            first = first_chunk_of_constrained(stub, MIXED, f"question {n}")
            assert first.reasoning_parser == DEEPSEEK_R1 and first.grammar_after_reasoning
    old, new = mesh.workers["mixed-old"], mesh.workers["mixed-new"]
    assert not old.steps, "the older worker got none of them"
    assert len(new.steps) == 6
    assert all(step.grammar and step.HasField("grammar_after_reasoning") for step in new.steps.values())


def test_with_only_older_workers_a_grammar_is_refused_unavailable_naming_sampling_structured(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub, pytest.raises(grpc.RpcError) as refused:
        first_chunk_of_constrained(stub, OLD_ONLY, "question")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details().startswith(
        "no worker of model r1-old:1 honours sampling.structured (WORKER_FEATURE_STRUCTURED_OUTPUT)")
    assert not mesh.workers["old"].steps


def test_a_worker_that_cannot_wait_gets_the_grammar_over_the_whole_output_and_the_first_chunk_says_so(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        first = first_chunk_of_constrained(stub, NO_WAIT, "question")
    assert first.reasoning_parser == DEEPSEEK_R1 and not first.grammar_after_reasoning
    (step,) = mesh.workers["no-wait"].steps.values()
    assert step.grammar and not step.HasField("grammar_after_reasoning")
