"""Scheduler.Submit at the scheduler's own port, real processes: many calls on one stream.

One toy classifier and one toy generator worker (10 ms per step), so several
sequences share steps and their chunks can share a ReplyBatch.
"""

from __future__ import annotations

import queue

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from tests.support.submit_session import SubmitSession, cancel_entry, classify_entry, generate_entry, text_of
from tools.testbed import session_tls
from tools.testbed.processes import running_mesh
from tools.testbed.scheduler_fixtures import (
    CLASSIFIER,
    GENERATOR,
    classify_request,
    generate_request,
    pressure_of,
    scheduler_stub,
    toy_continuation,
    wait_for_idle_kv,
    wait_for_workers,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(tmp_path_factory.mktemp("scheduler-submit")) as mesh:
        mesh.start_scheduler("--deadline-margin-ms", "100")
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator", "--toy-compute-ms", "10")
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, CLASSIFIER, 1)
            wait_for_workers(stub, GENERATOR, 1)
        yield mesh


@pytest.fixture
def stub(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        yield stub


@pytest.fixture
def session(stub):
    session = SubmitSession(stub)
    yield session
    session.close()


def _unary_error(call) -> tuple[int, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code().value[0], caught.value.details()


def test_bad_entries_fail_alone_with_the_unary_status_while_others_succeed(stub, session):
    no_image = scheduler_pb2.ScheduleClassifyRequest(
        request=gateway_pb2.ClassifyRequest(model=CLASSIFIER), tenant=classify_request("t").tenant
    )
    unknown = generate_request("abc", 3)
    unknown.request.model.name = "no-such-model"
    bad_sampling = generate_request("abc", 3)
    bad_sampling.request.sampling.top_p = 2.0
    session.send(
        classify_entry(1, classify_request("t")), classify_entry(2, no_image), generate_entry(3, unknown),
        generate_entry(4, generate_request("abc", 4)), generate_entry(5, bad_sampling),
    )
    replies = session.replies_until_done(1, 2, 3, 4, 5)

    assert [label.label for label in replies[1][0].classify.labels] == ["bright"]
    assert text_of(replies[4]) == toy_continuation("abc", 4)
    for call_id, unary in ((2, lambda: stub.Classify(no_image, timeout=5)),
                           (3, lambda: list(stub.Generate(unknown, timeout=5))),
                           (5, lambda: list(stub.Generate(bad_sampling, timeout=5)))):
        (reply,) = replies[call_id]
        assert (reply.error.code, reply.error.message) == _unary_error(unary)


def test_generate_on_the_stream_matches_the_unary_stream_and_shares_messages_per_step(stub, session):
    prompts = {10 + i: prompt for i, prompt in enumerate(("abc", "klm", "xyz"))}
    session.send(*(generate_entry(call_id, generate_request(prompt, 20)) for call_id, prompt in prompts.items()))
    replies = session.replies_until_done(*prompts)

    for call_id, prompt in prompts.items():
        unary = [response.chunk for response in stub.Generate(generate_request(prompt, 20), timeout=10)]
        chunks = [reply.chunk for reply in replies[call_id]]
        assert [list(c.token_ids) for c in chunks] == [list(c.token_ids) for c in unary]
        assert [c.index for c in chunks] == [c.index for c in unary]
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 20)
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[0].model.name == "toy-generator"
    shared = [batch for batch in session.batches if len({reply.call_id for reply in batch.replies}) == 3]
    assert shared, "the three sequences ran in the same steps, so their chunks share messages"


def test_cancel_entry_aborts_the_sequence_and_frees_its_kv_blocks(stub, session):
    session.send(generate_entry(20, generate_request("abc", 400), timeout_us=30_000_000))
    while len(session.by_call[20]) < 5:
        session.read_batch()
    assert pressure_of(stub, GENERATOR).kv_usage > 0
    session.send(cancel_entry(20))
    assert wait_for_idle_kv(stub, GENERATOR, timeout_s=2.0) < 1.0


def test_closing_the_stream_aborts_every_call_on_it(stub):
    session = SubmitSession(stub)
    session.send(generate_entry(1, generate_request("abc", 400)), generate_entry(2, generate_request("klm", 400)))
    while len(session.by_call[2]) < 3:
        session.read_batch()
    session.close()
    assert wait_for_idle_kv(stub, GENERATOR, timeout_s=2.0) < 1.0


def test_a_calls_timeout_ends_it_with_deadline_exceeded(stub, session):
    session.send(generate_entry(30, generate_request("abc", 400), timeout_us=600_000))
    (last,) = session.replies_until_done(30)[30][-1:]
    assert last.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert last.error.message.startswith("deadline passed after ")
    wait_for_idle_kv(stub, GENERATOR, timeout_s=2.0)


def test_malformed_entries_get_invalid_argument(session):
    session.send(scheduler_pb2.SubmitEntry(call_id=0, classify=classify_request("t")),
                 scheduler_pb2.SubmitEntry(call_id=7))
    while not (session.is_done(0) and session.is_done(7)):
        session.read_batch()
    assert [(r.error.code, r.error.message) for r in session.by_call[0]] == [(3, "entry.call_id must be >= 1")]
    assert [(r.error.code, r.error.message) for r in session.by_call[7]] == [
        (3, "entry 7 has none of classify, generate or cancel")
    ]


def test_undecodable_bytes_end_the_stream_with_invalid_argument_while_a_generation_streams(mesh):
    """Sent while the writer is busy with a long generation's chunks: the status must still arrive."""
    outgoing: queue.Queue = queue.Queue()

    def requests():
        while (item := outgoing.get()) is not None:
            yield item

    entry = generate_entry(1, generate_request("abc", 200))
    with session_tls.channel(mesh.scheduler.address) as channel:
        submit = channel.stream_stream("/infermesh.v1.Scheduler/Submit", request_serializer=lambda raw: raw,
                                       response_deserializer=scheduler_pb2.ReplyBatch.FromString)
        call = submit(requests(), timeout=20)
        outgoing.put(scheduler_pb2.SubmitBatch(entries=[entry]).SerializeToString())
        first = next(call)
        assert first.replies[0].call_id == 1
        outgoing.put(b"\xff\xff\xff\xff")  # not a SubmitBatch
        try:
            with pytest.raises(grpc.RpcError) as caught:
                for _ in call:
                    pass
        finally:
            outgoing.put(None)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
    assert "not a valid message" in caught.value.details()
