"""n > 1 and best_of at the gateway: the choices' streams merged (no transport, fake streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.fronts import openai_choices


class FakeStreams:
    """Each request's stream: `length` chunks whose text names the request, one per event-loop turn."""

    def __init__(self, length: int = 3, fail: str | None = None) -> None:
        self.length, self.fail = length, fail
        self.started: list[str] = []
        self.further: list[str] = []  # those started as further choices (not judged on TTFT again)
        self.closed: list[str] = []
        self.first_chunk_before: dict[str, int] = {}  # request id -> streams started when its first chunk left

    def start(self, request: gateway_pb2.GenerateRequest, further: bool, on_admitted: Callable[[], None]
              ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        self.started.append(request.request_id)
        if further:
            self.further.append(request.request_id)
        return self._stream(request.request_id, on_admitted)

    async def _stream(self, request_id: str, on_admitted: Callable[[], None]):
        on_admitted()
        try:
            for i in range(self.length):
                await asyncio.sleep(0)
                if request_id == self.fail and i == 1:
                    raise errors.Unavailable(f"{request_id} broke")
                if i == 0:
                    self.first_chunk_before[request_id] = len(self.started)
                yield gateway_pb2.GenerateResponse(request_id=request_id, text=f"{request_id}:{i}", index=i)
        finally:
            self.closed.append(request_id)


def _requests(n: int) -> list[gateway_pb2.GenerateRequest]:
    return openai_choices.choice_requests(gateway_pb2.GenerateRequest(request_id="r"), n)


async def test_the_other_choices_start_after_the_first_choices_first_chunk_and_all_arrive_in_order():
    streams = FakeStreams()
    seen = [(i, chunk.text) async for i, chunk in openai_choices.merged(streams.start, _requests(3))]
    assert streams.first_chunk_before["r-0"] == 1, "the first choice ran alone until its first chunk"
    assert streams.further == ["r-1", "r-2"], "the first choice alone is judged on the request's TTFT target"
    assert seen[0] == (0, "r-0:0")
    for index in range(3):
        assert [text for i, text in seen if i == index] == [f"r-{index}:{k}" for k in range(3)]
    assert sorted(streams.closed) == ["r-0", "r-1", "r-2"]


async def test_one_choices_error_ends_the_merge_and_closes_every_stream():
    streams = FakeStreams(length=50, fail="r-1")
    with pytest.raises(errors.Unavailable, match="r-1 broke"):
        async for _ in openai_choices.merged(streams.start, _requests(3)):
            pass
    assert sorted(streams.closed) == ["r-0", "r-1", "r-2"]


async def test_closing_the_merge_early_closes_every_stream():
    streams = FakeStreams(length=50)
    merged = openai_choices.merged(streams.start, _requests(2))
    await anext(merged)
    await anext(merged)
    await merged.aclose()
    assert sorted(streams.closed) == ["r-0", "r-1"]


async def test_one_choice_is_its_own_stream():
    streams = FakeStreams()
    seen = [chunk.text async for _, chunk in openai_choices.merged(streams.start, _requests(1))]
    assert seen == ["r:0", "r:1", "r:2"] and streams.started == ["r"] and streams.further == []


def _grpc(**fields) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id="r", **fields)


@pytest.mark.parametrize(("fields", "message"), [
    ({"n": 17}, "n must be in 0..16, got 17"),
    ({"n": 3, "best_of": 2}, "best_of must be 0 or in n..16 (3..16), got 2"),
    ({"best_of": 17}, "best_of must be 0 or in n..16 (1..16), got 17"),
])
def test_grpc_n_and_best_of_out_of_range_are_invalid_argument(fields, message):
    with pytest.raises(errors.InvalidArgument) as caught:
        openai_choices.grpc_choices(_grpc(**fields))
    assert caught.value.message == message


def test_grpc_best_of_runs_a_seeded_candidate_each_and_asks_for_logprobs_to_rank_by():
    plan = openai_choices.grpc_choices(_grpc(n=2, best_of=3, sampling=common_pb2.SamplingParams(seed=9)))
    assert (plan.n, plan.ranked, plan.logprobs) == (2, True, False)
    assert [(r.request_id, r.sampling.seed, r.sampling.logprobs, r.n, r.best_of) for r in plan.requests] == [
        ("r-0", 9, True, 0, 0), ("r-1", 10, True, 0, 0), ("r-2", 11, True, 0, 0)]
    same = openai_choices.grpc_choices(_grpc(n=2, best_of=2))
    assert (same.ranked, len(same.requests), same.requests[0].sampling.logprobs) == (False, 2, False)
    assert openai_choices.grpc_choices(_grpc(best_of=1)).requests[0].request_id == "r"


def _candidate(index: int, logprobs: list[float], *, chunks: int = 2) -> list[tuple[int, gateway_pb2.GenerateResponse]]:
    """A candidate's chunks: its logprobs split over `chunks` chunks, the last with usage."""
    per = -(-len(logprobs) // chunks)
    out = []
    for start in range(0, len(logprobs), per):
        part = logprobs[start:start + per]
        chunk = gateway_pb2.GenerateResponse(request_id=f"r-{index}", text=f"{index}@{start}", index=start,
                                             logprobs=[common_pb2.PositionLogprobs(
                                                 token=common_pb2.TokenLogprob(logprob=v)) for v in part])
        out.append((index, chunk))
    out[-1][1].finish_reason = common_pb2.FINISH_REASON_LENGTH
    out[-1][1].usage.completion_tokens = len(logprobs)
    return out


async def _ranked(plan, items) -> list[tuple[int, gateway_pb2.GenerateResponse]]:
    async def choices():
        for item in items:
            yield item

    return [item async for item in openai_choices.ranked(choices(), plan)]


async def test_grpc_best_of_returns_the_best_mean_logprob_candidates_whole_best_first():
    plan = openai_choices.GrpcChoices([_grpc()] * 3, 2, False)
    # Interleaved, as merged yields them: candidate 2 is best (-0.5 a token), then 0 (-1), then 1 (-2, shorter).
    c0, c1, c2 = _candidate(0, [-1, -1, -1, -1]), _candidate(1, [-2, -2]), _candidate(2, [-0.25, -0.75, -0.5, -0.5])
    c0[0][1].prompt_logprobs.add().token.logprob = -4.0  # the first candidate's first chunk brought them
    seen = await _ranked(plan, [c0[0], c1[0], c2[0], c2[1], c0[1], c1[1]])
    assert [(rank, chunk.text) for rank, chunk in seen] == [(0, "2@0"), (0, "2@2"), (1, "0@0"), (1, "0@2")]
    assert all(not chunk.logprobs for _, chunk in seen), "ranked by them, not asked for: not returned"
    assert [chunk.unreturned_completion_tokens for _, chunk in seen] == [0, 0, 0, 2]
    assert [[p.token.logprob for p in chunk.prompt_logprobs] for _, chunk in seen] == [[-4.0], [], [], []]


async def test_grpc_best_of_returns_the_logprobs_when_asked_and_refuses_a_candidate_cut_short():
    plan = openai_choices.GrpcChoices([_grpc()] * 2, 1, True)
    seen = await _ranked(plan, [*_candidate(0, [-3.0]), *_candidate(1, [-1.0])])
    assert [(rank, [p.token.logprob for p in chunk.logprobs]) for rank, chunk in seen] == [(0, [-1.0])]
    with pytest.raises(errors.Internal):
        await _ranked(plan, [*_candidate(0, [-3.0]), _candidate(1, [-1.0, -1.0])[0]])


def _result(logprobs: list[float]) -> openai_choices.ChoiceResult:
    result = openai_choices.ChoiceResult()
    result.add(gateway_pb2.GenerateResponse(logprobs=[common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(logprob=v)) for v in logprobs], finish_reason=common_pb2.FINISH_REASON_STOP))
    return result


def _same(ranked: list, expected: list) -> bool:
    return [id(r) for r in ranked] == [id(r) for r in expected]


def test_best_of_ranks_a_candidate_that_ended_at_once_after_every_one_with_a_token():
    """End of sequence first: no token streamed, so no logprob to average (the end token is counted in
    usage, never streamed, and its logprob does not reach the gateway); the mean over no token is
    undefined, and such a candidate ranks after every one with a token, whatever their logprobs
    (lower index first among such)."""
    empty, worst, best, empty_too = _result([]), _result([-30.0, -30.0]), _result([-0.5]), _result([])
    assert _same(openai_choices.best([empty, worst, best, empty_too], 4), [best, worst, empty, empty_too])
    assert _same(openai_choices.best([empty_too, empty, worst], 2), [worst, empty_too])


def test_best_of_averages_only_the_tokens_with_a_logprob():
    """A token from a worker that sent no logprob (one predating them) is NaN on the wire: the mean is
    over the others, and a candidate with none at all ranks as one that ended at once (never a NaN sort key)."""
    nan = float("nan")
    partial, whole, unknown = _result([nan, -0.25]), _result([-1.0, -1.0]), _result([nan, nan])
    assert _same(openai_choices.best([unknown, whole, partial], 3), [partial, whole, unknown])


async def test_batched_prompts_take_turns_each_merged_as_its_choices_are():
    streams = FakeStreams()
    groups = [openai_choices.choice_requests(gateway_pb2.GenerateRequest(request_id=rid), 2) for rid in ("a", "b")]
    seen = [(g, i, chunk.text) async for g, i, chunk in openai_choices.merged_groups(streams.start, groups)]
    assert streams.started[:2] == ["a-0", "b-0"], "the other prompts' first choices start once the first was admitted"
    assert sorted(streams.further) == ["a-1", "b-0", "b-1"], "the first prompt's first choice alone is judged on TTFT"
    for g, rid in enumerate(("a", "b")):
        for i in range(2):
            assert [text for gg, ii, text in seen if (gg, ii) == (g, i)] == [f"{rid}-{i}:{k}" for k in range(3)]
    assert sorted(streams.closed) == ["a-0", "a-1", "b-0", "b-1"]


async def test_one_prompts_error_ends_the_batch_and_closes_every_stream():
    streams = FakeStreams(length=50, fail="b-0")
    groups = [openai_choices.choice_requests(gateway_pb2.GenerateRequest(request_id=rid), 2) for rid in ("a", "b")]
    with pytest.raises(errors.Unavailable, match="b-0 broke"):
        async for _ in openai_choices.merged_groups(streams.start, groups):
            pass
    assert sorted(streams.closed) == sorted(streams.started)


async def test_one_group_is_the_plain_merge():
    streams = FakeStreams()
    seen = [(g, i) async for g, i, _ in openai_choices.merged_groups(streams.start, [_requests(2)])]
    assert {g for g, _ in seen} == {0} and sorted({i for _, i in seen}) == [0, 1]
