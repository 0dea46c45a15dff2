"""The inputs of one /v1/embeddings request, each run as a request of its own (admitted, counted, its own
sequence), in turns: at most MAX_PARALLEL_INPUTS at once, and an input the gateway sheds at admission
(ResourceExhausted: the model's adaptive limit, its TTFT objective, the tenant's quotas) while inputs of
its own request hold places waits until one of them ends, then asks again. The first input is admitted
before the others start, and only it is judged on its TTFT target, as a completion's first choice is
(generate_core's further_choice): the others queue behind their siblings, a burst the request itself sent,
which read as a missed target for the later ones (429 ttft_objective_missed for 2048 inputs on an idle mesh).

Without the turns a request was refused by its own inputs: the default adaptive limit (64) leaves 57
places to standard traffic, so on an idle mesh every request of 58 or more inputs answered 503 overloaded,
and a retry could never succeed (helper-81's probe; OpenAI allows 2048 inputs, LangChain sends 1000).
Shed with none of its own inputs in flight, the refusal is the request's answer, as for any request:
another tenant's load still refuses it, with its retry hint, and no input waits on itself forever. A
refusal after admission (upstream) stands: so every end an input waits for is a served input's, and a
request makes at most one more attempt per waiting input per input served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from infermesh.v1 import gateway_pb2
from services.common import errors

# Inputs of one request in flight at once: each is admitted as a request, so a large batch does not
# take the gateway's whole concurrency at once.
MAX_PARALLEL_INPUTS = 64

# (request, further, on_admitted) -> its chunks: GenerateCore.generate for the caller; `further`: an input
# after the first (not judged on its TTFT); on_admitted is called once the gateway admitted the request.
Start = Callable[[gateway_pb2.GenerateRequest, bool, Callable[[], None]],
                  AsyncGenerator[gateway_pb2.GenerateResponse, None]]


class _OwnInputs:
    """How many of the request's inputs are admitted and not ended, and a signal at each end."""

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

    async def next_end(self) -> None:
        await self._ended.wait()


async def run_inputs(start: Start, requests: Sequence[gateway_pb2.GenerateRequest],
                     refusal: Callable[[errors.InfermeshError, int], errors.InfermeshError]
                     ) -> list[gateway_pb2.GenerateResponse]:
    """Every input's last chunk, in order. The first refusal that stands (`refusal(err, index)`: in the
    client's terms) fails them all and cancels the others."""
    limit = asyncio.Semaphore(MAX_PARALLEL_INPUTS)
    own = _OwnInputs()
    first_admitted = asyncio.Event()

    async def one(index: int, request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateResponse:
        if index:
            await first_admitted.wait()  # the first's refusal (a failed gather) cancels this wait
        async with limit:
            while True:
                ends_seen = own.num_ended
                attempt = _Attempt(own, first_admitted if index == 0 else None)
                try:
                    return await _embedded(start, request, attempt)
                except errors.ResourceExhausted as err:
                    # Refused once admitted (upstream): the request's answer, as any other refusal.
                    if attempt.admitted or (own.num_ended == ends_seen and own.num_admitted == 0):
                        raise refusal(err, index) from None
                    if own.num_ended == ends_seen:  # else one ended meanwhile: ask again at once
                        await own.next_end()
                except errors.InfermeshError as err:
                    raise refusal(err, index) from None

    tasks = [asyncio.ensure_future(one(i, r)) for i, r in enumerate(requests)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # the others' sequences are aborted when one input fails or the client leaves


class _Attempt:
    """One try of an input: whether the gateway admitted it, counted among its request's own while it runs."""

    def __init__(self, own: _OwnInputs, first_admitted: asyncio.Event | None) -> None:
        self.own = own
        self.first_admitted = first_admitted  # the first input's: set when it is admitted
        self.admitted = False

    @property
    def further(self) -> bool:
        return self.first_admitted is None

    def on_admitted(self) -> None:
        self.admitted = True
        self.own.admitted()
        if self.first_admitted is not None:
            self.first_admitted.set()


async def _embedded(start: Start, request: gateway_pb2.GenerateRequest, attempt: _Attempt
                    ) -> gateway_pb2.GenerateResponse:
    sent = gateway_pb2.GenerateRequest()
    sent.CopyFrom(request)  # as parsed: admission writes into the request it admits (seed, objectives)
    last = None
    try:
        async with aclosing(start(sent, attempt.further, attempt.on_admitted)) as chunks:
            async for chunk in chunks:
                last = chunk
    finally:
        if attempt.admitted:
            attempt.own.ended()
    if last is None or not last.embedding:
        raise errors.Internal("the scheduler's answer carried no embedding")
    return last
