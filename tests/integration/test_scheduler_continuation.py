"""Continuations at the scheduler's own RPCs, real processes: a stream resumed from the tokens a
client already received gives exactly the unbroken stream's tail (ids, text, indexes, usage), on
both transports and coalesced, greedy (toy generator) and seeded sampling (mock generator, whose
token is a function of seed, position and last token); bad continuations are INVALID_ARGUMENT."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from tests.support.submit_session import SubmitSession, generate_entry
from tools.testbed.generator_models import MOCK, TOY
from tools.testbed.processes import running_mesh
from tools.testbed.scheduler_fixtures import scheduler_stub, tenant, wait_for_workers

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with running_mesh(tmp_path_factory.mktemp("scheduler-continuation")) as mesh:
        mesh.start_scheduler()
        mesh.start_worker(TOY.name, *TOY.worker_args(2))
        mesh.start_worker(MOCK.name, *MOCK.worker_args(2))
        with scheduler_stub(mesh.scheduler.address) as stub:
            wait_for_workers(stub, TOY.ref, 1)
            wait_for_workers(stub, MOCK.ref, 1)
        yield mesh


@pytest.fixture
def stub(mesh):
    with scheduler_stub(mesh.scheduler.address) as stub:
        yield stub


@dataclass(frozen=True)
class Chunks:
    """What a client read from one stream: every chunk's ids, text and index, and how it ended."""

    token_ids: list[int]
    text: str
    first_index: int
    indexes_contiguous: bool
    completion_tokens: int
    finish_reason: int


def collect(chunks: list[gateway_pb2.GenerateResponse]) -> Chunks:
    token_ids, texts, expected, contiguous = [], [], None, True
    for chunk in chunks:
        if chunk.token_ids:
            if expected is not None and chunk.index != expected:
                contiguous = False
            expected = chunk.index + len(chunk.token_ids)
            token_ids.extend(chunk.token_ids)
        texts.append(chunk.text)
    first = next((c.index for c in chunks if c.token_ids), None)
    return Chunks(token_ids, "".join(texts), first, contiguous, chunks[-1].usage.completion_tokens,
                  chunks[-1].finish_reason)


def request(model, prompt: str, max_tokens: int, delivered=(), *, temperature: float = 0.0, seed: int | None = None,
            max_tokens_per_chunk: int = 0) -> scheduler_pb2.ScheduleGenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    if seed is not None:
        sampling.seed = seed
    req = scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(model=model.ref, prompt=prompt, sampling=sampling), tenant=tenant("tests"))
    if max_tokens_per_chunk:
        req.request.stream.max_tokens_per_chunk = max_tokens_per_chunk
    if delivered:
        req.continuation.token_ids.extend(delivered)
    return req


def unary(stub, req) -> Chunks:
    return collect([reply.chunk for reply in stub.Generate(req, timeout=20)])


def assert_is_tail(resumed: Chunks, whole: Chunks, num_delivered: int) -> None:
    assert resumed.token_ids == whole.token_ids[num_delivered:]
    assert resumed.text == bytes(whole.token_ids[num_delivered:]).decode()
    assert resumed.first_index == num_delivered and resumed.indexes_contiguous
    assert (resumed.completion_tokens, resumed.finish_reason) == (whole.completion_tokens, whole.finish_reason)


@pytest.mark.parametrize("num_delivered", [1, 17, 39])
def test_greedy_continuation_gives_the_unbroken_streams_tail(stub, num_delivered):
    whole = unary(stub, request(TOY, "hello", 40))
    assert whole.text == TOY.continuation("hello", 40) and whole.completion_tokens == 40
    resumed = unary(stub, request(TOY, "hello", 40, whole.token_ids[:num_delivered]))
    assert_is_tail(resumed, whole, num_delivered)


@pytest.mark.parametrize("num_delivered", [1, 20, 47])
def test_seeded_sampling_continuation_samples_token_for_token_what_the_unbroken_stream_did(stub, num_delivered):
    whole = unary(stub, request(MOCK, "seeded", 48, temperature=0.8, seed=1234))
    assert whole.completion_tokens == 48
    assert whole.token_ids != unary(stub, request(MOCK, "seeded", 48, temperature=0.8, seed=99)).token_ids
    resumed = unary(stub, request(MOCK, "seeded", 48, whole.token_ids[:num_delivered], temperature=0.8, seed=1234))
    assert_is_tail(resumed, whole, num_delivered)


def test_continuation_on_a_submit_stream_and_coalesced_gives_the_same_tail(stub):
    whole = unary(stub, request(MOCK, "submit", 30, temperature=0.5, seed=7))
    session = SubmitSession(stub)
    try:
        session.send(
            generate_entry(1, request(MOCK, "submit", 30, whole.token_ids[:9], temperature=0.5, seed=7)),
            generate_entry(2, request(MOCK, "submit", 30, whole.token_ids[:9], temperature=0.5, seed=7,
                                      max_tokens_per_chunk=4)),
        )
        replies = session.replies_until_done(1, 2)
    finally:
        session.close()
    plain = collect([r.chunk for r in replies[1]])
    coalesced = collect([r.chunk for r in replies[2]])
    assert_is_tail(plain, whole, 9)
    assert_is_tail(coalesced, whole, 9)
    assert all(len(r.chunk.token_ids) <= 4 for r in replies[2])


@pytest.mark.parametrize(
    ("req", "message"),
    [
        (request(TOY, "abc", 8, [97, 999]), "continuation.token_ids[1] = 999 is outside the vocabulary"),
        (request(TOY, "abc", 3, [100, 101, 102]), "continuation has 3 tokens but max_tokens is 3"),
        (request(MOCK, "abc", 8, [97], temperature=0.7), "temperature > 0 needs sampling.seed"),
        (request(TOY, "abc", 600, [100]), "exceeds the model's max sequence length"),
    ],
)
def test_bad_continuations_are_invalid_argument(stub, req, message):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(req, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
