"""Stream coalescing (GenerateRequest.stream) through the gateway, real processes.

Coalesced and uncoalesced streams of the same request must carry identical token
ids, text, usage and finish reason; only the grouping into chunks differs, and
each chunk's index is the number of tokens before it. Both gateway upstream modes
(unary Scheduler.Generate and the Submit stream) go through the same coalescer.
"""

from __future__ import annotations

import math

import grpc
import pytest

from infermesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tools.testbed import session_tls
from tools.testbed.gateway_fixtures import GENERATOR, bearer, spawn_gateway, status_of, tenant, write_tenants
from tools.testbed.processes import running_mesh, wait_until
from tools.testbed.scheduler_fixtures import scheduler_stub, wait_for_workers

pytestmark = pytest.mark.integration

MOCK = common_pb2.ModelRef(name="mock-generator")
TINYLM = common_pb2.ModelRef(name="tinylm")
TOKENS_KEY = "coalesced-tokens-secret-0123"
BY_COUNT = gateway_pb2.StreamOptions(max_tokens_per_chunk=4)
BY_INTERVAL = gateway_pb2.StreamOptions(interval_ms=50)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stream-coalescing")
    tenants = write_tenants(tmp / "tenants.yaml", [
        tenant("tokens", TOKENS_KEY, "standard", ["toy-generator"], tokens_per_s=0.01, tokens_burst=40),
    ])
    with running_mesh(tmp) as mesh:
        mesh.start_scheduler()
        mesh.start_worker("toy-generator", "--toy-compute-ms", "5")
        mesh.start_worker("mock-generator", "--mock-profile", "step_ms=5")
        mesh.unary = spawn_gateway(mesh, "gateway-unary", "--upstream-mode", "unary")
        mesh.stream = spawn_gateway(mesh, "gateway-stream", "--upstream-mode", "stream")
        mesh.quota = spawn_gateway(mesh, "gateway-quota", "--upstream-mode", "stream", "--tenants-file", str(tenants))
        with scheduler_stub(mesh.scheduler.address) as stub:
            for model in (GENERATOR, MOCK):
                wait_for_workers(stub, model, 1)
        yield mesh


@pytest.fixture(scope="module")
def stubs(mesh):
    with session_tls.channel(mesh.unary.address) as unary, session_tls.channel(mesh.stream.address) as stream:
        yield {"unary": gateway_pb2_grpc.InferenceStub(unary), "stream": gateway_pb2_grpc.InferenceStub(stream)}


def _generate(stub, model, prompt: str, stream: gateway_pb2.StreamOptions | None = None,
              metadata=(), **sampling) -> list[gateway_pb2.GenerateResponse]:
    request = gateway_pb2.GenerateRequest(model=model, prompt=prompt, sampling=common_pb2.SamplingParams(**sampling),
                                          stream=stream)
    return list(stub.Generate(request, timeout=30, metadata=metadata))


def _content(chunks: list[gateway_pb2.GenerateResponse]) -> tuple:
    """What must not depend on the grouping: all token ids, all text, how it ended, usage."""
    last = chunks[-1]
    return ([t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
            last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens)


def _assert_well_formed(chunks: list[gateway_pb2.GenerateResponse]) -> None:
    seen = 0
    for chunk in chunks:
        assert chunk.index == seen, "each chunk's index is the number of tokens before it"
        seen += len(chunk.token_ids)
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert all(not c.HasField("usage") for c in chunks[:-1])
    assert chunks[-1].timings.total_us > 0
    assert chunks[0].model.name and chunks[-1].model.name


CASES = {
    "toy-greedy": (GENERATOR, "abc", {"max_tokens": 21}),
    "mock-greedy": (MOCK, "hello", {"max_tokens": 21}),
    "mock-seeded": (MOCK, "hello", {"max_tokens": 21, "temperature": 0.8, "top_p": 0.9, "seed": 77}),
}


@pytest.mark.parametrize("mode", ["unary", "stream"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_of_k_carry_the_same_tokens_text_and_usage(stubs, mode, case):
    model, prompt, sampling = CASES[case]
    plain = _generate(stubs[mode], model, prompt, **sampling)
    coalesced = _generate(stubs[mode], model, prompt, BY_COUNT, **sampling)
    assert _content(coalesced) == _content(plain)
    _assert_well_formed(plain)
    _assert_well_formed(coalesced)
    assert [len(c.token_ids) for c in plain] == [1] * 21
    # The first token at once, then full chunks of 4; the last (20 = 5 x 4) closes the fifth.
    sizes = [len(c.token_ids) for c in coalesced]
    assert sizes == [1, 4, 4, 4, 4, 4]
    assert len(coalesced) == 1 + math.ceil(20 / 4)


@pytest.mark.parametrize("mode", ["unary", "stream"])
@pytest.mark.parametrize("case", ["toy-greedy", "mock-seeded"])
def test_chunks_by_interval_carry_the_same_tokens_text_and_usage(stubs, mode, case):
    model, prompt, sampling = CASES[case]
    sampling = {**sampling, "max_tokens": 40}
    plain = _generate(stubs[mode], model, prompt, **sampling)
    coalesced = _generate(stubs[mode], model, prompt, BY_INTERVAL, **sampling)
    assert _content(coalesced) == _content(plain)
    _assert_well_formed(coalesced)
    assert len(coalesced[0].token_ids) == 1, "the first token does not wait for the interval"
    # Steps take ~5 ms, so a 50 ms interval holds several tokens per chunk (how many depends on load).
    assert len(coalesced) < len(plain) == 40


@pytest.mark.parametrize("stream", [BY_COUNT, BY_INTERVAL], ids=["k4", "t50ms"])
def test_stop_strings_cut_the_text_exactly_as_uncoalesced(stubs, stream):
    # The toy model continues "abc" with "defgh...": the stop string ends the text before "ijk".
    plain = _generate(stubs["stream"], GENERATOR, "abc", max_tokens=30, stop=["ijk"])
    coalesced = _generate(stubs["stream"], GENERATOR, "abc", stream, max_tokens=30, stop=["ijk"])
    assert "".join(c.text for c in plain) == "defgh"
    assert _content(coalesced) == _content(plain)
    assert coalesced[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    _assert_well_formed(coalesced)


def test_tinylm_coalesced_matches_uncoalesced(mesh, stubs):
    mesh.start_worker("tinylm")
    with scheduler_stub(mesh.scheduler.address) as stub:
        wait_for_workers(stub, TINYLM, 1)
    sampling = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    plain = _generate(stubs["stream"], TINYLM, "The Python ", **sampling)
    coalesced = _generate(stubs["stream"], TINYLM, "The Python ", BY_COUNT, **sampling)
    assert _content(coalesced) == _content(plain)
    _assert_well_formed(coalesced)
    assert len(coalesced) < len(plain)


def _tokens_left(stub, need_max_tokens: int) -> float:
    """The tenant's token bucket, read from a refusal (rate 0.01/s, so retry-after = missing / 0.01)."""
    need = 5 + need_max_tokens  # "abc": 3 prompt bytes + 2, plus max_tokens
    got = status_of(lambda: _generate(stub, GENERATOR, "abc", max_tokens=need_max_tokens, metadata=bearer(TOKENS_KEY)))
    assert got.code == grpc.StatusCode.RESOURCE_EXHAUSTED, got
    return need - got.retry_delay_s * 0.01


def test_a_cancelled_coalesced_stream_is_refunded_by_the_tokens_it_carried(mesh):
    # Burst 40, refill ~0. Charged 5 + 30 = 35 up front; cancelled after the chunks of 1 and 4
    # tokens (maybe more chunks reached the gateway first), the gateway keeps prompt + tokens sent:
    # counted by token_ids per chunk, the tokens kept are 5 + 1 + 4m, never 5 + the number of chunks.
    with session_tls.channel(mesh.quota.address) as channel:
        stub = gateway_pb2_grpc.InferenceStub(channel)
        request = gateway_pb2.GenerateRequest(model=GENERATOR, prompt="abc", stream=BY_COUNT,
                                              sampling=common_pb2.SamplingParams(max_tokens=30))
        call = stub.Generate(request, timeout=30, metadata=bearer(TOKENS_KEY))
        assert [len(next(call).token_ids) for _ in range(2)] == [1, 4]
        call.cancel()
        left: list[float] = []
        wait_until(lambda: left.append(round(_tokens_left(stub, 35))) or left[-1] > 40 - 35, timeout_s=10,
                   message="the gateway refunds the cancelled stream")
        kept = 40 - left[-1]
        assert kept - 5 >= 5 and (kept - 5) % 4 == 1, f"kept {kept} tokens"
