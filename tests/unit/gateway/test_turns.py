"""A request's parts take turns (turns.py: an embeddings request's inputs, a completion's prompts and
choices): a part shed at admission while parts of its own request run waits for one of them to end, so a
batch larger than what the gateway admits at once is served (it was a 503 from 58 parts on: its own parts
filled the model's limit); shed with none of its own running, or refused after admission, the refusal
stands; other refusals fail the request at once. Only the first part is judged on its TTFT, and the others
start once it was admitted; a part may also wait for an earlier one's first chunk. Streamed, every part's
chunks come in its order, and closing the stream closes every part. A fake admission with a fixed limit
stands in for the gateway's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

import pytest

from infermesh.v1 import gateway_pb2
from services.common import errors
from services.gateway.fronts import turns
from services.gateway.fronts.turns import Part, in_turns, last_chunks

HANG_GUARD_S = 30  # a wrong wait would hang for ever: fail instead (no test here waits on time)


class LimitedModel:
    """Admits at most `limit` requests at once (ResourceExhausted beyond, as the adaptive limit does),
    each answered after a few loop turns with its first token id as its vector (in `num_chunks` chunks, a
    loop turn apart, each with its position as `index`); `fail_after_admission`: each admitted request then
    refused upstream instead. `events` logs ("ask", part) at each attempt and ("first", part) at each first chunk."""

    def __init__(self, limit: int, fail_after_admission: errors.InfermeshError | None = None,
                 num_chunks: int = 1) -> None:
        self.limit = limit
        self.fail_after_admission = fail_after_admission
        self.num_chunks = num_chunks
        self.events: list[tuple[str, int]] = []
        self.num_in_flight = 0
        self.most_in_flight = 0
        self.num_attempts = 0
        self.seeds_seen: list[int] = []
        self.num_admitted = 0
        self.judged: list[tuple[int, bool, int]] = []  # (input, judged on its TTFT, admitted before it asked)

    async def generate(self, request: gateway_pb2.GenerateRequest, further: bool, on_admitted: Callable[[], None]
                       ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        self.num_attempts += 1
        self.events.append(("ask", request.prompt_token_ids[0]))
        self.seeds_seen.append(request.sampling.seed)
        self.judged.append((request.prompt_token_ids[0], not further, self.num_admitted))
        if self.num_in_flight >= self.limit:
            raise errors.ResourceExhausted("overloaded: the adaptive limit", retry_after_s=0.02)
        self.num_in_flight += 1
        self.num_admitted += 1
        self.most_in_flight = max(self.most_in_flight, self.num_in_flight)
        request.sampling.seed = 7  # admission writes into the request (fix_seed): a retry must not carry it
        try:
            on_admitted()
            for _ in range(3):
                await asyncio.sleep(0)
            if self.fail_after_admission is not None:
                raise self.fail_after_admission
            for position in range(self.num_chunks):
                if position == 0:
                    self.events.append(("first", request.prompt_token_ids[0]))
                else:
                    await asyncio.sleep(0)
                yield gateway_pb2.GenerateResponse(embedding=[float(request.prompt_token_ids[0])], index=position)
        finally:
            self.num_in_flight -= 1


def inputs(num: int) -> list[gateway_pb2.GenerateRequest]:
    return [gateway_pb2.GenerateRequest(prompt_token_ids=[i], embed=gateway_pb2.EmbedOptions()) for i in range(num)]


def named(err: errors.InfermeshError, index: int) -> errors.InfermeshError:
    return type(err)(f"input[{index}]: {err.message}")


def run(model: LimitedModel, num_inputs: int) -> list[gateway_pb2.GenerateResponse]:
    return asyncio.run(asyncio.wait_for(last_chunks(model.generate, inputs(num_inputs), named), HANG_GUARD_S))


@pytest.mark.parametrize(("limit", "num_inputs"), [(57, 58), (57, 2048), (5, 200), (1, 30)])
def test_a_batch_larger_than_the_limit_is_served_in_turns_in_order(limit, num_inputs):
    model = LimitedModel(limit)
    lasts = run(model, num_inputs)
    assert [last.embedding[0] for last in lasts] == [float(i) for i in range(num_inputs)]
    assert model.most_in_flight == min(limit, turns.MAX_PARALLEL_PARTS)
    assert set(model.seeds_seen) == {0}  # every attempt sent the request as parsed
    # Only the first is judged on its TTFT, and the others ask once it was admitted (as a completion's choices).
    assert model.judged[0] == (0, True, 0)
    assert all(not judged and admitted_before >= 1 for _, judged, admitted_before in model.judged[1:])


def test_the_first_inputs_refusal_is_the_answer_and_no_other_input_is_sent():
    model = LimitedModel(0)
    with pytest.raises(errors.ResourceExhausted, match=r"input\[0\]: overloaded"):
        run(model, 100)
    assert model.num_attempts == 1


def test_shed_with_none_of_its_own_running_the_refusal_is_the_answer():
    """Another tenant's load takes the places its own inputs left: the next input shed, with none of its
    own running, is refused for the request (no input waits on itself)."""
    model = LimitedModel(1)
    original = model.generate

    def others_take_the_place_after_the_first(request, further, on_admitted):
        if further:
            model.limit = 0
        return original(request, further, on_admitted)

    with pytest.raises(errors.ResourceExhausted, match=r"input\[[1-9]\d*\]: overloaded"):
        asyncio.run(asyncio.wait_for(last_chunks(others_take_the_place_after_the_first, inputs(5), named),
                                     HANG_GUARD_S))
    assert model.num_attempts <= 2 * 5


def test_a_refusal_after_admission_stands():
    """Refused upstream once admitted: the request's answer. Were it retried, two inputs refused in turn would
    wake each other for ever; the waiting ones woken by the first end may ask once more before the cancel."""
    model = LimitedModel(4, fail_after_admission=errors.ResourceExhausted("the scheduler's queue is full"))
    with pytest.raises(errors.ResourceExhausted, match="queue is full"):
        run(model, 40)
    assert model.num_attempts <= 2 * 40


def test_any_other_refusal_fails_the_request_at_once():
    model = LimitedModel(4, fail_after_admission=errors.InvalidArgument("prompt_token_ids[0] past the vocabulary"))
    with pytest.raises(errors.InvalidArgument, match=r"input\[\d+\]: prompt_token_ids"):
        run(model, 40)
    assert model.num_in_flight == 0  # the others were cancelled, their places given back


def choices(num_prompts: int, n: int) -> list[Part]:
    """A completion's prompts x n choices as parts: each prompt's later choices after its first choice."""
    return [Part(inputs(num_prompts * n)[k * n + i], after=k * n if i else None)
            for k in range(num_prompts) for i in range(n)]


async def streamed(model: LimitedModel, parts: list[Part]) -> list[tuple[int, gateway_pb2.GenerateResponse]]:
    async def gather() -> list[tuple[int, gateway_pb2.GenerateResponse]]:
        return [item async for item in in_turns(model.generate, parts, named)]

    return await asyncio.wait_for(gather(), HANG_GUARD_S)


@pytest.mark.parametrize(("limit", "num_prompts", "n"), [(38, 100, 1), (5, 12, 4), (57, 8, 16)])
async def test_streamed_parts_past_the_limit_each_come_whole_in_order_and_interleaved(limit, num_prompts, n):
    model = LimitedModel(limit, num_chunks=4)
    parts = choices(num_prompts, n)
    seen = await streamed(model, parts)
    for index in range(len(parts)):
        assert [chunk.index for i, chunk in seen if i == index] == [0, 1, 2, 3], index
    assert [i for i, _ in seen] != sorted(i for i, _ in seen), "the parts' chunks interleave"
    assert model.most_in_flight == min(limit, turns.MAX_PARALLEL_PARTS)
    assert model.num_in_flight == 0
    # A prompt's later choices ask after its first choice's first chunk (its prompt's blocks are then cached).
    for index, part in enumerate(parts):
        if part.after is not None:
            assert model.events.index(("ask", index)) > model.events.index(("first", part.after)), index


async def test_the_first_parts_failure_before_its_first_chunk_starts_no_choice_after_it():
    model = LimitedModel(10, fail_after_admission=errors.Unavailable("the worker went away"))
    with pytest.raises(errors.Unavailable, match=r"input\[0\]: the worker went away"):
        await streamed(model, choices(1, 8))
    assert model.num_attempts == 1 and model.num_in_flight == 0


async def test_closing_the_stream_closes_every_part_and_starts_no_other():
    """A client that goes away: every running part's stream is closed (its sequence cancelled upstream,
    its KV freed), and those waiting for a place never start."""
    model = LimitedModel(1000, num_chunks=1000)
    chunks = in_turns(model.generate, choices(100, 1), named)
    for _ in range(200):
        await asyncio.wait_for(anext(chunks), HANG_GUARD_S)
    assert model.num_in_flight == turns.MAX_PARALLEL_PARTS
    await chunks.aclose()
    assert model.num_in_flight == 0
    asked = model.num_attempts
    for _ in range(10):
        await asyncio.sleep(0)
    assert model.num_attempts == asked == turns.MAX_PARALLEL_PARTS


async def test_one_part_is_sent_as_it_is_and_judged_on_its_ttft():
    model = LimitedModel(1, num_chunks=3)
    request = inputs(1)[0]
    seen = [item async for item in in_turns(model.generate, [Part(request)], named)]
    assert [(i, chunk.index) for i, chunk in seen] == [(0, 0), (0, 1), (0, 2)]
    assert request.sampling.seed == 7, "the request itself went upstream (admission wrote into it)"
    assert model.judged == [(0, True, 0)]
    refused = LimitedModel(0)
    with pytest.raises(errors.ResourceExhausted, match=r"input\[0\]: overloaded"):
        await streamed(refused, [Part(inputs(1)[0])])
