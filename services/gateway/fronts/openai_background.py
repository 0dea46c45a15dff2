"""Background Responses (`background: true`): admitted while their request waits, answered once admitted
(the Response `queued`, or its stream followed from the first event), then run on in the gateway's
event loop, what they end as kept under their id (openai_stored_http.py keeps and serves them).

The request waits for admission only, never for the model: a refusal that admission makes (the
tenant's quotas, the gateway's in-flight cap, shedding, an unknown or forbidden model) is the answer,
with its own status (429, 503, 404, ...) and nothing is kept, as OpenAI answers such a request up front.
What fails after admission (the scheduler refusing it, a worker lost) ends the Response `failed`.

A streamed one (with `stream: true`) runs as a stream whose writes go nowhere: its events reach the
clients through its event log (response_event_log.py), which the POST that created it follows and any
GET with stream=true can follow again; a client that goes away leaves it running.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from infermesh.v1 import gateway_pb2
from services.common import errors
from services.gateway.calls.generate_core import Caller
from services.gateway.fronts import openai_batch, openai_codec, openai_responses
from services.gateway.fronts.openai_stored_http import StoredResponsesFront, streamed

if TYPE_CHECKING:
    from services.gateway.fronts.openai_http import ResponsesShape

log = logging.getLogger(__name__)

Choices = AsyncGenerator[tuple[int, int, gateway_pb2.GenerateResponse], None]
Parts = list[openai_codec.OpenAIRequest]


@dataclass(frozen=True)
class Generation:
    """The HTTP front's own ways to run a request, which a background Response runs as any other does."""

    # (caller, request, its prompts, told once admitted) -> the choices' chunks
    chunks: Callable[[Caller, openai_codec.OpenAIRequest, Parts, Callable[[], None]], Choices]
    # the whole answer's body from the chunks (and the last chunk)
    whole: Callable[[openai_codec.OpenAIRequest, Parts, Choices], Awaitable[tuple[dict, Any]]]
    # the answer's events from the chunks, written to the given response
    stream: Callable[[web.Request, openai_codec.OpenAIRequest, Parts, Choices, Any, web.StreamResponse],
                     Awaitable[web.StreamResponse]]


class _Nowhere(web.StreamResponse):
    """A response whose writes go nowhere: a background stream's events are read from its log."""

    async def prepare(self, request: Any) -> None:
        return None

    async def write(self, data: Any) -> None:
        return None

    async def write_eof(self, data: bytes = b"") -> None:
        return None


async def answer(stored: StoredResponsesFront, generation: Generation, request: web.Request, caller: Caller,
                 parsed: openai_codec.OpenAIRequest, shape: ResponsesShape) -> web.StreamResponse:
    """Starts the background Response and answers once admission let it through; raises its refusal."""
    admitted: asyncio.Future[dict] = asyncio.get_running_loop().create_future()
    response_id = openai_responses.response_id(parsed.generate.request_id)
    stored.run_in_background(response_id, _run(generation, request, caller, parsed, shape, admitted))
    try:
        queued = await asyncio.shield(admitted)  # this request going away leaves it running
    except errors.InfermeshError as err:
        raise shape.refusal(openai_codec.upstream_refusal(err, parsed)) from None
    if shape.log is None:
        return web.json_response(queued, dumps=_dumps)
    return await streamed(request, shape.log, -1)


async def _run(generation: Generation, request: web.Request, caller: Caller, parsed: openai_codec.OpenAIRequest,
               shape: ResponsesShape, admitted: asyncio.Future[dict]) -> None:
    """The Response's run: queued once admitted (the request's answer), in_progress, then what it ends as
    (completed or incomplete, failed with the error its request would have had, or cancelled)."""

    def on_admitted() -> None:
        if not admitted.done():
            admitted.set_result(shape.kept_as("queued"))
            shape.kept_as("in_progress")

    parts = openai_batch.prompt_parts(parsed)
    try:
        async with aclosing(generation.chunks(caller, parsed, parts, on_admitted)) as chunks:
            if shape.log is None:
                body, _ = await generation.whole(parsed, parts, chunks)
                shape.body(body)
            else:
                first = await anext(chunks, None)  # admission and the first token
                if first is None:
                    raise errors.Internal("the stream ended without its last chunk")
                await generation.stream(request, parsed, parts, _prepended(first, chunks), shape, _Nowhere())
    except errors.InfermeshError as err:
        if not admitted.done():  # refused at admission: the request answers it, and nothing is kept
            admitted.set_exception(err)
            return
        refusal = shape.refusal(openai_codec.upstream_refusal(err, parsed))
        _failed(shape, openai_codec.error_reply(refusal).body["error"]["message"])
    except asyncio.CancelledError:
        if admitted.done():
            shape.kept_as("cancelled")
        else:  # the front closed before admission answered: so does the request
            admitted.set_exception(errors.Unavailable("the gateway is shutting down"))
        raise
    except Exception:  # a bug: what the middleware makes a 500 elsewhere; its poller must still see it end
        log.exception("background response %s failed", openai_responses.response_id(parsed.generate.request_id))
        if not admitted.done():
            admitted.set_exception(errors.Internal("internal error (logged by the gateway)"))
            return
        _failed(shape, "internal error (logged by the gateway)")
    finally:
        if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
            shape.ended()


def _failed(shape: ResponsesShape, message: str) -> None:
    """Kept failed; a stream that had not started says so in its events too (created, then failed)."""
    if shape.log is not None and shape.log.next_sequence == 0:
        shape.opened()
        shape.failed({"error": {"message": message}})
    else:
        shape.kept_as("failed", {"code": "server_error", "message": message})


async def _prepended(first: tuple[int, int, gateway_pb2.GenerateResponse], rest: Choices) -> Choices:
    yield first
    async for chunk in rest:
        yield chunk


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
