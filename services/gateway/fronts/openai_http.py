"""The OpenAI-compatible HTTP front (aiohttp): /v1/completions, /v1/chat/completions, /v1/responses (on the
chat path: openai_responses.py; stored ones under /v1/responses/{id} when the gateway stores them:
openai_stored_http.py), /v1/conversations[/{id}[/items[/{item_id}]]] (openai_conversations_http.py),
/v1/embeddings (openai_embeddings.py), /v1/models[/{id}], and vLLM's /tokenize and /detokenize (and, when
the gateway is asked to, its /tokenizer_info).

Thin: read the caller from the headers, parse the body (openai_codec), run the same
GenerateCore as the gRPC Generate, write JSON or server-sent events, map domain errors to
OpenAI's error shape. Headers (docs/clients.md):

    Authorization: Bearer <key>    the tenant's API key, as the gRPC `authorization` metadata
    x-infermesh-priority           critical | standard | sheddable: lowers the tenant's class, never raises it
    x-infermesh-timeout-ms         the request's deadline, milliseconds (the gateway's default when absent,
                                   clamped to its --max-deadline-ms)
    x-request-start                the client's send time (t=<unix time>), for the ingress stage
    traceparent / tracestate       W3C trace context, trusted as --trust-trace-context says

A streamed request is admitted before the response starts, so its refusals get their real
status code; an error after the first event is sent as a last `data: {"error": ...}` event.
A client that disconnects cancels its handler (handler_cancellation), which closes the
generation: the upstream stream is cancelled and the scheduler frees the sequence's blocks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing

from aiohttp import web

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.calls.generate_core import Caller, GenerateCore
from services.gateway.calls.text_calls import TextCalls
from services.gateway.fronts import (
    json_body,
    openai_background,
    openai_batch,
    openai_choices,
    openai_codec,
    openai_embeddings,
    openai_responses,
    openai_tokenize,
    tool_calls,
)
from services.gateway.fronts.caller import http_authorization, http_caller
from services.gateway.fronts.http_refusals import refusal_middleware
from services.gateway.fronts.openai_conversations_http import ConversationsFront
from services.gateway.fronts.openai_stored_http import Keep, StoredResponses, StoredResponsesFront
from services.gateway.fronts.reasoning import ReasoningFormat, ReasoningSplitter
from services.gateway.fronts.response_event_log import EventLog
from services.gateway.tenants.credentials import Authorization

TIMINGS_HEADER = "x-infermesh-timings"
REQUEST_ID_HEADER = "x-request-id"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
_LIST_MODELS_TIMEOUT_S = 5.0
_TEXT_TIMEOUT_S = 10.0

# (prompt, choice index within the prompt, chunk); one prompt unless the completion batched several
Choices = AsyncGenerator[tuple[int, int, gateway_pb2.GenerateResponse], None]
ListModels = Callable[[Authorization, float], Awaitable[gateway_pb2.ListModelsResponse]]
JsonAnswer = Callable[[web.Request], Awaitable[dict | web.StreamResponse]]  # a stream: already written


def error_response(err: errors.InfermeshError) -> web.Response:
    reply = openai_codec.error_reply(err)
    return web.json_response(reply.body, status=reply.status, headers=reply.refusal.headers(), dumps=_dumps)


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _event(value: dict) -> bytes:
    return b"data: " + _dumps(value).encode() + b"\n\n"


class ChatShape:
    """How an answer of the chat path is written: completions' and chat's own JSON and events."""

    def body(self, body: dict) -> dict:
        return body

    def refusal(self, err: errors.InfermeshError) -> errors.InfermeshError:
        return err

    def opened(self) -> bytes:
        return b""

    def event(self, value: dict) -> bytes:
        return _event(value)

    def failed(self, error_body: dict) -> bytes:
        return _event(error_body)

    def closed(self) -> bytes:
        return _DONE


class ResponsesShape(ChatShape):
    """The Responses API's: a Response object, or its named events (no [DONE]). `keep`: stores the
    finished Response (a whole one, an incomplete one, a failed stream's) before the client sees it
    finish, so its next turn finds it; its `store` then says whether it was kept. `log`: where a
    background stream's events go as they are written (openai_background.py)."""

    def __init__(self, wanted: openai_responses.ResponsesRequest, parsed: openai_codec.OpenAIRequest,
                 created_s: int, keep: Keep | None = None, log: EventLog | None = None) -> None:
        self._wanted = wanted
        self._request_id = parsed.generate.request_id
        self._created_s = created_s
        self._model = parsed.model
        self._events = openai_responses.ResponseEvents(wanted, self._request_id, created_s, parsed.model)
        self._keep = keep
        self.background = wanted.background  # answered once admitted and run on in the gateway's loop
        self.log = log
        self._last: dict | None = None  # the Response as last kept

    def kept_as(self, status: str, error: dict | None = None) -> dict:
        """A background Response as it stands before its answer (queued, in_progress) or instead of one
        (failed, cancelled: no output), kept so its poller reads it."""
        return self._kept(openai_responses.response_object(self._wanted, self._request_id, self._created_s,
                                                           self._model, output=[], status=status, error=error))

    def body(self, body: dict) -> dict:
        return self._kept(openai_responses.completed(self._wanted, body, self._request_id))

    def ended(self) -> None:
        """A background stream's end: kept again with all its events counted, then its log closed."""
        if self.log is not None:
            if self._last is not None:
                self._kept(self._last)
            self.log.close()

    def _kept(self, response: dict) -> dict:
        if self._keep is not None:
            response["store"] = self._keep(response)
            self._last = response
        return response

    def _written(self, events: list[dict]) -> bytes:
        data = [_named_event(e) for e in events]
        if self.log is not None:
            self.log.extend((e["sequence_number"], d) for e, d in zip(events, data, strict=True))
        return b"".join(data)

    def _last_kept(self, events: list[dict]) -> list[dict]:
        self._kept(events[-1]["response"])
        return events

    def refusal(self, err: errors.InfermeshError) -> errors.InfermeshError:
        return openai_responses.renamed(err) if isinstance(err, openai_codec.BadParameter) else err

    def opened(self) -> bytes:
        return self._written(self._events.opened())

    def event(self, value: dict) -> bytes:
        return self._written(self._events.chunk(value))

    def failed(self, error_body: dict) -> bytes:
        return self._written(self._last_kept(self._events.failed(error_body["error"])))

    def closed(self) -> bytes:
        return self._written(self._last_kept(self._events.closed()))


def _named_event(event: dict) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _dumps(event).encode() + b"\n\n"


class OpenAIFront:
    def __init__(self, core: GenerateCore, list_models: ListModels, authenticate: Callable[[Authorization], object],
                 clock=time.time, text: TextCalls | None = None, stored: StoredResponses | None = None,
                 tokenizer_info: bool = False) -> None:
        """authenticate: the tenants' own check (Unauthenticated), asked only of a request whose body is refused,
        so a caller without a valid key learns nothing about what the gateway would accept.
        text: vLLM's /tokenize and /detokenize (none: not served).
        tokenizer_info: with text, vLLM's GET /tokenizer_info too (--enable-tokenizer-info-endpoint).
        stored: the stored Responses (none: nothing is stored, and previous_response_id is a 400)."""
        self._core = core
        self._list_models = list_models
        self._authenticate = authenticate
        self._clock = clock
        self._text = text
        self._tokenizer_info = tokenizer_info
        self._stored = StoredResponsesFront(stored, authenticate)
        self._embeddings = openai_embeddings.EmbeddingsFront(core, self._refusal, error_response, _json_body, _dumps)
        self._conversations = ConversationsFront(stored, authenticate, _json_body, clock)

    def routes(self) -> list[web.RouteDef]:
        routes = [
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/responses", self.responses),
            web.post("/v1/embeddings", self._embeddings.embeddings),
            web.get("/v1/responses/{response_id}", _json_answer(self._stored.retrieve)),
            web.delete("/v1/responses/{response_id}", _json_answer(self._stored.delete)),
            web.get("/v1/responses/{response_id}/input_items", _json_answer(self._stored.input_items)),
            web.post("/v1/responses/{response_id}/cancel", _json_answer(self._stored.cancel)),
            *self._conversations.routes(_json_answer),
            web.get("/v1/models", self.models),
            # Ids may hold slashes (Hugging Face style, "org/name"), as stock clients put them in the path.
            web.get("/v1/models/{model:.+}", self.model),
        ]
        if self._text is not None:
            routes += [web.post("/tokenize", self.tokenize), web.post("/detokenize", self.detokenize)]
            if self._tokenizer_info:
                routes.append(web.get("/tokenizer_info", self.tokenizer_info))
        return routes

    async def tokenize(self, request: web.Request) -> web.Response:
        async def answer(body, authorization: Authorization) -> dict:
            parsed, token_strs = openai_tokenize.parse_tokenize(body)
            reply = await self._text_calls().tokenize(parsed, authorization, _TEXT_TIMEOUT_S)
            return openai_tokenize.tokenize_body(reply, token_strs)

        return await self._text_answer(request, answer)

    async def detokenize(self, request: web.Request) -> web.Response:
        async def answer(body, authorization: Authorization) -> dict:
            reply = await self._text_calls().detokenize(openai_tokenize.parse_detokenize(body), authorization,
                                                        _TEXT_TIMEOUT_S)
            return openai_tokenize.detokenize_body(reply)

        return await self._text_answer(request, answer)

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        try:
            reply = await self._text_calls().tokenizer_info(openai_tokenize.parse_tokenizer_info(request.query),
                                                            http_authorization(request), _TEXT_TIMEOUT_S)
        except errors.InfermeshError as err:
            return error_response(self._refusal(request, err))
        return web.json_response(openai_tokenize.tokenizer_info_body(reply), dumps=_dumps)

    async def _text_answer(self, request: web.Request,
                           answer: Callable[[object, Authorization], Awaitable[dict]]) -> web.Response:
        """/tokenize's or /detokenize's JSON answer, or its refusal in OpenAI's error shape."""
        try:
            body = await answer(await _json_body(request), http_authorization(request))
        except errors.InfermeshError as err:
            return error_response(self._refusal(request, err))
        return web.json_response(body, dumps=_dumps)

    def _text_calls(self) -> TextCalls:
        assert self._text is not None  # the routes exist only with it
        return self._text

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: (openai_codec.parse_completion(body), ChatShape()))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: (openai_codec.parse_chat(body), ChatShape()))

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: self._parse_responses(body, request))

    def _parse_responses(self, body: object, request: web.Request) -> tuple[openai_codec.OpenAIRequest, ChatShape]:
        """A Responses request as the chat request it is (after the stored turn it continues, if any),
        and the shape its answer is written in."""
        scope, chain, body = self._stored.continued(body, request)
        wanted = openai_responses.chat_request(body, storing=self._stored.storing, earlier=chain.items)
        try:
            parsed = openai_codec.parse_chat(wanted.chat)
        except openai_codec.BadParameter as err:
            raise openai_responses.renamed(err) from None
        parsed.generate.request_id = parsed.generate.request_id or uuid.uuid4().hex  # names the Response and its items
        log = self._stored.event_log(wanted)
        keep = (self._stored.keeper(scope, chain, wanted, parsed.generate.request_id, log)
                if wanted.store or wanted.conversation else None)
        return parsed, ResponsesShape(wanted, parsed, int(self._clock()), keep, log)

    async def close(self) -> None:
        """Ends what runs on after its request was answered: background Responses."""
        await self._stored.close()

    async def models(self, request: web.Request) -> web.Response:
        try:
            data = await self._model_objects(request)
        except errors.InfermeshError as err:
            return error_response(err)
        return web.json_response({"object": "list", "data": data}, dumps=_dumps)

    async def model(self, request: web.Request) -> web.Response:
        """One model as GET /v1/models lists it (a stock client's `models.retrieve`); 404 for one the key may
        not use as for one not served, as the list shows neither."""
        name = request.match_info["model"]
        try:
            found = [m for m in await self._model_objects(request) if m["id"] == name]
            if not found:
                raise errors.NotFound(f"model '{name}' is not served to this key (GET /v1/models lists those that are)")
        except errors.InfermeshError as err:
            return error_response(err)
        return web.json_response(found[0], dumps=_dumps)

    async def _model_objects(self, request: web.Request) -> list[dict]:
        """The generators the caller's key may use, as OpenAI's model objects (with their versions and context)."""
        listed = await self._list_models(http_authorization(request), _LIST_MODELS_TIMEOUT_S)
        created_s = int(self._clock())
        names = sorted({info.model.name for info in listed.models if info.kind == common_pb2.MODEL_KIND_GENERATOR})
        # A LoRA adapter names its base model as `parent`, as vLLM's list does (None: a model of its own).
        parents = {info.model.name: info.parent for info in listed.models if info.parent}
        return [{"id": name, "object": "model", "created": created_s, "owned_by": "infermesh",
                 "versions": sorted(i.model.version for i in listed.models if i.model.name == name),
                 "max_model_len": max(i.max_seq_len for i in listed.models if i.model.name == name),
                 "parent": parents.get(name)}
                for name in names]

    async def _generate(self, request: web.Request, parse) -> web.StreamResponse:
        """`parse(body)`: the request and the shape its answer is written in."""
        try:
            caller = http_caller(request)
            parsed, shape = parse(await _json_body(request))
        except errors.InfermeshError as err:
            return error_response(self._refusal(request, err))
        if isinstance(shape, ResponsesShape) and shape.background:
            generation = openai_background.Generation(self._chunks, self._whole, self._stream)
            return await openai_background.answer(self._stored, generation, request, caller, parsed, shape)
        parts = openai_batch.prompt_parts(parsed)
        async with aclosing(self._chunks(caller, parsed, parts)) as chunks:
            if parsed.stream:
                return await self._stream(request, parsed, parts, chunks, shape)
            return await self._complete(parsed, parts, chunks, shape)

    def _chunks(self, caller: Caller, parsed: openai_codec.OpenAIRequest,
                parts: list[openai_codec.OpenAIRequest], on_admitted: Callable[[], None] | None = None) -> Choices:
        def start(request: gateway_pb2.GenerateRequest, further: bool, admitted: Callable[[], None]):
            def told() -> None:
                admitted()  # the part's turn (turns.py), then the front's own (a background Response)
                if on_admitted is not None:
                    on_admitted()

            return self._core.generate(request, caller, further_choice=further, on_admitted=told)

        return openai_choices.merged_groups(
            start, [openai_choices.choice_requests(part.generate, parsed.best_of) for part in parts])

    def _refusal(self, request: web.Request, err: errors.InfermeshError) -> errors.InfermeshError:
        """What a request whose headers or body are refused is told: Unauthenticated first, if it is."""
        try:
            self._authenticate(http_authorization(request))
        except errors.Unauthenticated as refused:
            return refused
        return err

    async def _complete(self, parsed: openai_codec.OpenAIRequest, parts: list[openai_codec.OpenAIRequest],
                        chunks: Choices, shape: ChatShape) -> web.Response:
        try:
            body, last = await self._whole(parsed, parts, chunks)
        except errors.InfermeshError as err:
            return error_response(shape.refusal(openai_codec.upstream_refusal(err, parsed)))
        headers = {REQUEST_ID_HEADER: parsed.generate.request_id, TIMINGS_HEADER: openai_codec.timings_header(last)}
        return web.json_response(shape.body(body), headers=headers, dumps=_dumps)

    async def _whole(self, parsed: openai_codec.OpenAIRequest, parts: list[openai_codec.OpenAIRequest],
                     chunks: Choices) -> tuple[dict, gateway_pb2.GenerateResponse]:
        """The whole answer's body (completions' or chat's), and the first choice's last chunk (its timings)."""
        results = [[openai_choices.ChoiceResult() for _ in range(parsed.best_of)] for _ in parts]
        async for part, index, chunk in chunks:
            results[part][index].add(chunk)
        if not all(result.finished for generated in results for result in generated):
            raise errors.Internal("the stream ended without its last chunk")
        created_s = int(self._clock())
        bodies, firsts = [], []
        for prompt_request, generated in zip(parts, results, strict=True):
            returned = openai_choices.best(generated, parsed.n) if parsed.best_of > parsed.n else generated
            bodies.append(openai_codec.full_response(prompt_request, created_s, returned, generated))
            firsts.append(returned[0])
        last = firsts[0].last
        assert last is not None  # every result finished
        return openai_batch.batch_response(bodies, parsed.n), last

    async def _stream(self, request: web.Request, parsed: openai_codec.OpenAIRequest,
                      parts: list[openai_codec.OpenAIRequest], chunks: Choices, shape: ChatShape,
                      response: web.StreamResponse | None = None) -> web.StreamResponse:
        """`response`: where the events are written (a background stream's writes go nowhere); the request's own."""
        try:
            first = await anext(chunks)  # admission and the first token, before any byte is sent
        except errors.InfermeshError as err:
            return error_response(shape.refusal(openai_codec.upstream_refusal(err, parsed)))
        except StopAsyncIteration:
            return error_response(errors.Internal("the stream ended without its last chunk"))
        if response is None:
            response = web.StreamResponse(headers={**_SSE_HEADERS, REQUEST_ID_HEADER: parsed.generate.request_id})
        await response.prepare(request)
        created_s = int(self._clock())
        # Per choice (prompt k's choice i is choice k * n + i); per prompt, its logprobs, which its first
        # choice's first chunk brings before any other choice of that prompt starts.
        count = len(parts) * parsed.n
        writers = [openai_codec.LogprobsWriter(parts[c // parsed.n]) for c in range(count)]
        splitters = [tool_calls.ToolCallSplitter(parsed.tools) for _ in range(count)]
        parsers = [""] * count
        reasonings: list[ReasoningSplitter | None] = [None] * count  # chat: made from each choice's first chunk
        lasts: list[gateway_pb2.GenerateResponse | None] = [None] * count
        prompts: list[list] = [[] for _ in parts]
        response_id = openai_codec.response_id(parsed)

        def event(part: int, index: int, chunk: gateway_pb2.GenerateResponse) -> bytes:
            choice = part * parsed.n + index
            is_first, lasts[choice] = lasts[choice] is None, chunk
            if is_first:
                parsers[choice] = chunk.tool_call_parser
                if parsed.kind == openai_codec.CHAT and chunk.reasoning_parser:  # else every chunk is answer
                    reasonings[choice] = ReasoningSplitter(ReasoningFormat.of_chunk(chunk),
                                                           openai_codec.constrained(parsed))
                if index == 0:
                    prompts[part] = list(chunk.prompt_logprobs)
            body = openai_codec.stream_chunk(parts[part], created_s, chunk, is_first, writers[choice], choice,
                                             splitters[choice], parsers[choice], prompts[part], reasonings[choice])
            return shape.event({**body, "id": response_id})  # one id for the whole answer, whichever prompt

        await response.write(shape.opened() + event(*first))
        try:
            async for part, index, chunk in chunks:
                await response.write(event(part, index, chunk))
        except errors.InfermeshError as err:  # a grammar found endless while sampling, too: it names its parameter
            refusal = shape.refusal(openai_codec.upstream_refusal(err, parsed))
            await response.write(shape.failed(openai_codec.error_reply(refusal).body))
            await response.write_eof()
            return response
        if parsed.include_usage:
            n = parsed.n
            usages = [openai_codec.usage_chunk(part, created_s, *(c for c in lasts[k * n:(k + 1) * n] if c))
                      for k, part in enumerate(parts)]
            summed = openai_batch.summed_usage([u["usage"] for u in usages])
            await response.write(shape.event({**usages[0], "usage": summed}))
        await response.write(shape.closed())
        await response.write_eof()
        return response


def _json_answer(answer: JsonAnswer) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A route whose answer is a JSON object (or a stream it wrote), or its refusal in OpenAI's error shape."""
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            body = await answer(request)
        except errors.InfermeshError as err:
            return error_response(err)
        return body if isinstance(body, web.StreamResponse) else web.json_response(body, dumps=_dumps)

    return handler


async def _json_body(request: web.Request):
    try:
        return json_body.loads(await json_body.body(request), request.charset)
    except ValueError as exc:
        raise openai_codec.BadParameter(None, str(exc)) from None


def _plain_error(status: int, message: str) -> web.Response:
    if status == 500:
        body = openai_codec.error_body(message, "internal_error", code="internal")
    else:
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        body = openai_codec.error_body(message, kind, code=str(status))
    return web.json_response(body, status=status, dumps=_dumps)


# aiohttp's own refusals, domain errors and bugs, all in OpenAI's error shape.
openai_errors = refusal_middleware(error_response, _plain_error)
