"""The parts of one request, each run as a request of its own upstream (admitted, counted, its own sequence),
in turns: a completion's prompts and choices (n, best_of) on the OpenAI front and gRPC Generate, an
embeddings request's inputs. Their chunks come back interleaved as (part, chunk), each part's in order.

The rules, one place for every front:
- The first part is admitted before any other starts, and only it is judged on the request's TTFT target
  (generate_core's further_choice): the others queue behind their siblings, a burst the request itself sent,
  which would read as a missed target for the later ones (429 ttft_objective_missed for 2048 inputs on an
  idle mesh). A part may also wait for an earlier part's first chunk (`Part.after`): a prompt's later
  choices start once its first choice streamed, when the prompt's blocks are in the prefix cache.
- At most MAX_PARALLEL_PARTS of a request run at once, and a part the gateway sheds at admission
  (ResourceExhausted: the model's adaptive limit, its TTFT objective, the tenant's quotas) while parts of its
  own request are admitted waits until one of them ends, then asks again.
- Shed with none of its own admitted, the refusal is the request's answer, as for any request: another
  tenant's load still refuses it, with its retry hint, and no part waits on itself for ever. A refusal after
  admission (upstream) stands: so every end a part waits for is a served part's, and a request makes at most
  one more attempt per waiting part per part served. The first refusal that stands ends the request and
  closes every other part (their sequences are cancelled upstream, their KV blocks freed).

Without the turns a request was refused by its own parts: the default adaptive limit (64) leaves 57 places
to standard traffic, so on an idle mesh every request of 58 or more parts (prompts x choices, or inputs)
answered 503 overloaded, and a retry could never succeed (helper-81's probe; OpenAI allows 2048 embedding
inputs, lm-evaluation-harness and LangChain batch prompts). A shed part has sent no chunk (admission comes
first), so asking again shows the client nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from infermesh.v1 import gateway_pb2
from services.common import errors

# Parts of one request in flight at once: each is admitted as a request, so a large batch does not take
# the gateway's whole concurrency at once.
MAX_PARALLEL_PARTS = 64

# (request, further, on_admitted) -> its chunks: GenerateCore.generate for the caller. `further`: a part
# after the first (not judged on its TTFT); on_admitted is called once the gateway admitted the request.
Start = Callable[[gateway_pb2.GenerateRequest, bool, Callable[[], None]],
                  AsyncGenerator[gateway_pb2.GenerateResponse, None]]
# (a refusal that stands, the part's index) -> the request's answer, in the client's terms
Refusal = Callable[[errors.InfermeshError, int], errors.InfermeshError]


@dataclass(frozen=True)
class Part:
    request: gateway_pb2.GenerateRequest
    # An earlier part whose first chunk this one starts after (a prompt's first choice, for its later
    # choices); None: it starts once the first part was admitted.
    after: int | None = None


def as_is(err: errors.InfermeshError, index: int) -> errors.InfermeshError:
    return err


async def in_turns(start: Start, parts: Sequence[Part], refusal: Refusal = as_is
                   ) -> AsyncGenerator[tuple[int, gateway_pb2.GenerateResponse], None]:
    """(part index, chunk) of every part as chunks come, each part's in order. The first part's refusal is
    raised before any other part starts; the first refusal that stands (`refusal(err, index)`) is raised
    here and ends them all, and closing this closes every part's stream."""
    if len(parts) == 1:  # a request of its own: nothing to take turns with
        stream = start(parts[0].request, False, _nothing)
        try:
            async for chunk in stream:
                yield 0, chunk
        except errors.InfermeshError as err:
            raise refusal(err, 0) from None
        finally:
            await _close([stream])
        return
    turns = _Turns(start, parts, refusal)
    async with aclosing(interleaved([turns.chunks(index) for index in range(len(parts))])) as chunks:
        async for item in chunks:
            yield item


async def last_chunks(start: Start, requests: Sequence[gateway_pb2.GenerateRequest], refusal: Refusal = as_is
                      ) -> list[gateway_pb2.GenerateResponse]:
    """Every part's last chunk, in order (an embeddings request's inputs: none waits for another's first
    chunk, only for the first part's admission and a place); a part that sent none is an Internal error."""
    lasts: list[gateway_pb2.GenerateResponse | None] = [None] * len(requests)
    async with aclosing(in_turns(start, [Part(request) for request in requests], refusal)) as chunks:
        async for index, chunk in chunks:
            lasts[index] = chunk
    if any(last is None for last in lasts):
        raise errors.Internal("a part's stream ended without a chunk")
    return [last for last in lasts if last is not None]


def _nothing() -> None:
    return None


class _OwnParts:
    """How many of the request's parts are admitted and not ended, and a signal at each end."""

    def __init__(self) -> None:
        self.num_admitted = 0
        self.num_ended = 0
        self._ended = asyncio.Event()

    def admitted(self) -> None:
        self.num_admitted += 1

    def ended(self) -> None:
        self.num_admitted -= 1
        self.num_ended += 1
        ended, self._ended = self._ended, asyncio.Event()
        ended.set()

    async def may_ask_again(self, was_admitted: bool, ends_seen: int) -> bool:
        """After a part's ResourceExhausted: whether it asks again, once one of its own ended since its
        attempt began (`ends_seen`: num_ended then). Never once admitted (refused upstream), nor with none
        of its own running and none ended meanwhile."""
        if was_admitted or (self.num_ended == ends_seen and self.num_admitted == 0):
            return False
        if self.num_ended == ends_seen:
            await self._ended.wait()
        return True


class _Attempt:
    """One try of a part: whether the gateway admitted it, counted among its request's own while it runs."""

    def __init__(self, own: _OwnParts, first_admitted: asyncio.Event | None) -> None:
        self.own = own
        self.first_admitted = first_admitted  # the first part's: set when it is admitted
        self.admitted = False

    def on_admitted(self) -> None:
        self.admitted = True
        self.own.admitted()
        if self.first_admitted is not None:
            self.first_admitted.set()

    def ended(self) -> None:
        if self.admitted:
            self.own.ended()


class _Turns:
    """One request's parts and what they share: the places, the first part's admission, who started."""

    def __init__(self, start: Start, parts: Sequence[Part], refusal: Refusal) -> None:
        self._start = start
        self._parts = parts
        self._refusal = refusal
        self._places = asyncio.Semaphore(MAX_PARALLEL_PARTS)
        self._own = _OwnParts()
        self._first_admitted = asyncio.Event()
        self._started = [asyncio.Event() for _ in parts]  # each part's first chunk came (or it ended)

    async def chunks(self, index: int) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Part `index`'s chunks once its turn came; asked again after one of its own ended while shed at
        admission. The refusal that stands is raised in the client's terms."""
        await self._turn(index)
        async with self._places:
            request = self._parts[index].request
            as_parsed = gateway_pb2.GenerateRequest()
            as_parsed.CopyFrom(request)  # admission writes into what it admits (seed, objectives)
            while True:
                ends_seen = self._own.num_ended
                attempt = _Attempt(self._own, None if index else self._first_admitted)
                try:
                    async with aclosing(self._start(request, index > 0, attempt.on_admitted)) as stream:
                        async for chunk in stream:
                            self._mark_started(index)
                            yield chunk
                    self._mark_started(index)  # ended without a chunk: who waits for one need not
                    return
                except errors.ResourceExhausted as err:
                    if not await self._own.may_ask_again(attempt.admitted, ends_seen):
                        raise self._refusal(err, index) from None
                except errors.InfermeshError as err:
                    raise self._refusal(err, index) from None
                finally:
                    attempt.ended()
                request.CopyFrom(as_parsed)

    def _mark_started(self, index: int) -> None:
        """Part `index` sent its first chunk (or ended). The first part's proves it was admitted, should its
        start not have said so. Never set for a part that failed: the request ends with it, and no other
        part is to start meanwhile."""
        self._started[index].set()
        if index == 0:
            self._first_admitted.set()

    async def _turn(self, index: int) -> None:
        """Until part `index` may start: the first part's admission (a failed first part cancels this wait),
        and the first chunk of the part it starts after."""
        if index:
            await self._first_admitted.wait()
        after = self._parts[index].after
        if after is not None:
            await self._started[after].wait()


async def interleaved(streams: Sequence[AsyncGenerator[Any, None]]) -> AsyncGenerator[tuple[int, Any], None]:
    """(index, item) of every stream as items come, each stream's in order. An error of any stream is
    raised here; closing this (or an error) cancels the pumps and closes every stream."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(i, stream, queue)) for i, stream in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            index, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for pump in pumps:
            pump.cancel()
        for pump in pumps:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pump
        await _close(streams)


async def _close(streams: Sequence[AsyncGenerator[Any, None]]) -> None:
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def _pump(index: int, stream: AsyncGenerator[Any, None], queue: asyncio.Queue[tuple[int, Any]]) -> None:
    """Everything `stream` yields onto `queue` as (index, item), then (index, None); an error as (index, error)."""
    try:
        async for item in stream:
            queue.put_nowait((index, item))
    except Exception as exc:  # handed to the consumer, which raises it
        queue.put_nowait((index, exc))
        return
    queue.put_nowait((index, None))
