"""n > 1 and best_of at the gateway: the choices' streams merged (no transport, fake streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from infermesh.v1 import gateway_pb2
from services.common import errors
from services.gateway.fronts import openai_choices


class FakeStreams:
    """Each request's stream: `length` chunks whose text names the request, one per event-loop turn."""

    def __init__(self, length: int = 3, fail: str | None = None) -> None:
        self.length, self.fail = length, fail
        self.started: list[str] = []
        self.closed: list[str] = []
        self.first_chunk_before: dict[str, int] = {}  # request id -> streams started when its first chunk left

    def start(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        self.started.append(request.request_id)
        return self._stream(request.request_id)

    async def _stream(self, request_id: str):
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
    assert seen == ["r:0", "r:1", "r:2"] and streams.started == ["r"]
