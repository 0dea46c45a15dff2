"""The stored Responses' HTTP side (the gateway's --responses-store-bytes): the answers of GET and
DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel
(openai_http.py routes them and writes them, or their refusals), and what POST /v1/responses asks of
the store: the caller's scope, the stored turn it continues, keeping its answer, and running it on in
the background. Thin over openai_stored.py (OpenAI's shapes) and response_store.py (the memory).

Every read is the caller's tenant's: it is authenticated first (a caller without a valid key learns
nothing), and another tenant's id is not found, as an unknown one is. Without storing, a well-formed
id is not found either, with a message saying storing is off.

Background Responses run as tasks of the gateway's event loop, one per Response, until they end, are
cancelled (POST .../cancel) or the HTTP front closes; what they end as is kept under their id
(openai_background.py runs them). A streamed one keeps its events (response_event_log.py) with it:
the POST that created it and any GET with stream=true follow them (`streamed`), from after
`starting_after`, while it runs and after it ended.

A Response created with `conversation` continues from the conversation's items (as from a chain's)
and, once it completes (or ends incomplete at its token limit), its input and output items are added
to the conversation as it stands then, whether the Response itself is stored or not. One that fails
or is cancelled adds nothing; a conversation deleted, expired or pushed out meanwhile is not brought
back, and one the items would make larger than the whole store is left as it was.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from services.gateway.fronts import openai_responses, openai_stored
from services.gateway.fronts.caller import http_authorization
from services.gateway.fronts.openai_conversations import ConversationNotFound, items_bytes, with_items
from services.gateway.fronts.openai_params import BadParameter
from services.gateway.fronts.response_event_log import EventLog, EventsGone
from services.gateway.fronts.response_store import ResponseStore, StoredResponse
from services.gateway.tenants.credentials import Authorization

log = logging.getLogger(__name__)

Keep = Callable[[dict], bool]  # keeps a Response (its latest state); False when it cannot be kept
_COMPLETED = ("completed", "incomplete")  # the Responses whose items a conversation takes
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class StoredResponses:
    """The gateway's stored Responses: the store, and the scope a caller's Responses live under."""

    store: ResponseStore
    scope_of: Callable[[Authorization], str]  # the caller's tenant id; raises Unauthenticated as the tenants do


class StoredResponsesFront:
    def __init__(self, stored: StoredResponses | None, authenticate: Callable[[Authorization], object]) -> None:
        """stored: none when the gateway stores nothing. authenticate: the tenants' own check, for the
        refusals of a gateway that stores nothing."""
        self._stored = stored
        self._authenticate = authenticate
        self._running: dict[str, asyncio.Task] = {}  # background Response id -> its task, while it runs

    @property
    def storing(self) -> bool:
        return self._stored is not None

    # -- what POST /v1/responses asks --------------------------------------------------------

    def continued(self, body: object, request: web.Request) -> tuple[str | None, openai_stored.Chain, object]:
        """The caller's scope when the gateway stores Responses, the stored turn or conversation the request
        continues (previous_response_id or conversation; neither: an empty chain), and the body with its
        item_reference items resolved to the caller's stored items. A body that is not an object is
        chat_request's to refuse."""
        if self._stored is None or not isinstance(body, dict):
            return None, openai_stored.Chain(), body
        scope = self._stored.scope_of(http_authorization(request))
        store = self._stored.store
        resolved = openai_stored.resolved_input(body.get("input"), lambda item_id: store.find_item(scope, item_id))
        if resolved is not body.get("input"):
            body = {**body, "input": resolved}
        conversation_id = openai_stored.conversation_param(body)
        if conversation_id is not None:
            conversation = store.get_conversation(scope, conversation_id)
            if conversation is None:
                raise ConversationNotFound(conversation_id, "conversation")
            return scope, openai_stored.Chain(conversation.items(), items_bytes(conversation)), body
        previous = openai_stored.previous_response_id(body)
        if previous is None:
            return scope, openai_stored.Chain(), body
        return scope, openai_stored.chain_of(self._entry(scope, previous, "previous_response_id")), body

    def event_log(self, wanted: openai_responses.ResponsesRequest) -> EventLog | None:
        """Where a background stream's events are kept (none for any other Response): bounded as the
        store is, as no Response is kept larger."""
        if self._stored is None or not (wanted.background and wanted.streamed):
            return None
        return EventLog(self._stored.store.max_bytes)

    def keeper(self, scope: str | None, chain: openai_stored.Chain, wanted: openai_responses.ResponsesRequest,
               request_id: str, events: EventLog | None = None) -> Keep:
        """Keeps a Response of `wanted` (the request continuing `chain`) under the caller's scope, with
        its `events` while they fit beside it, if it is to be stored; adds its items to its conversation
        once it completes, if it names one."""
        # wanted.store or wanted.conversation: the gateway stores, and the scope was read
        assert self._stored is not None and scope is not None
        store = self._stored.store
        items = openai_stored.input_items(wanted.input, request_id)
        conversation_id = wanted.conversation
        added_to_conversation = False

        def keep(response: dict) -> bool:
            nonlocal added_to_conversation
            if conversation_id is not None and not added_to_conversation and response["status"] in _COMPLETED:
                added_to_conversation = True  # once: a background one is kept again as its events end
                _add_to_conversation(store, scope, conversation_id, items + tuple(response["output"]))
            if not wanted.store:
                return False
            response = {**response, "store": True}  # as a GET will show it
            if store.put(scope, response["id"], openai_stored.stored_response(response, chain, items, events)):
                return True
            if events is not None and store.put(scope, response["id"],
                                                openai_stored.stored_response(response, chain, items)):
                return True  # kept without its events: a GET with stream=true says so
            if response["background"]:  # its poller must still learn that it ended
                store.put(scope, response["id"], openai_stored.stored_response(
                    openai_stored.too_large(response), openai_stored.Chain(), ()))
            return False

        return keep

    def run_in_background(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work, name=f"background-{response_id}")
        self._running[response_id] = task
        task.add_done_callback(lambda _: self._running.pop(response_id, None))

    async def close(self) -> None:
        """Cancels the background Responses still running (each keeps its cancelled state)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- the answers (each raises a domain error for its refusal) --------------------------------

    async def retrieve(self, request: web.Request) -> dict | web.StreamResponse:
        """GET /v1/responses/{id}: the Response as it was answered, or a background one as it stands.
        With `stream=true`, a background stream's events after `starting_after` (from the first without
        it), then each as it comes until the Response ends."""
        entry = self._requested_entry(request)
        starting_after = openai_stored.stream_query(request.query)
        if starting_after is None:
            return entry.response
        events = openai_stored.replayed_events(entry)
        try:
            events.check(starting_after)  # before the stream starts: a 400
        except EventsGone as gone:
            raise BadParameter("starting_after", str(gone)) from None
        return await streamed(request, events, starting_after)

    async def delete(self, request: web.Request) -> dict:
        """DELETE /v1/responses/{id}: OpenAI's deleted object. Later turns that continued it keep their
        context; a background one still running is cancelled first."""
        store, scope, response_id = self._requested(request)
        self._entry(scope, response_id, None)
        await self._cancelled(response_id)
        store.delete(scope, response_id)
        return openai_stored.deleted(response_id)

    async def input_items(self, request: web.Request) -> dict:
        """GET /v1/responses/{id}/input_items: the items that produced it, earlier turns' included."""
        return openai_stored.input_items_page(self._requested_entry(request), request.query)

    async def cancel(self, request: web.Request) -> dict:
        """POST /v1/responses/{id}/cancel: a background Response, cancelled if it was still running (its
        state as it ended otherwise: cancelling twice is harmless). Only background ones can be."""
        _, scope, response_id = self._requested(request)
        if not self._entry(scope, response_id, None).response["background"]:
            raise BadParameter(None, f"response '{response_id}' was not created with background: true; only "
                                     "background responses can be cancelled")
        await self._cancelled(response_id)
        return self._entry(scope, response_id, None).response

    async def _cancelled(self, response_id: str) -> None:
        """Once a background Response's task, if it still runs, has ended cancelled (and kept so)."""
        task = self._running.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    def _requested(self, request: web.Request) -> tuple[ResponseStore, str, str]:
        """The store, the caller's scope and the response id in the path."""
        authorization = http_authorization(request)
        if self._stored is None:
            self._authenticate(authorization)
            raise openai_stored.ResponseNotFound(_path_response_id(request), why=openai_stored.STORING_OFF)
        scope = self._stored.scope_of(authorization)
        return self._stored.store, scope, _path_response_id(request)

    def _requested_entry(self, request: web.Request) -> StoredResponse:
        _, scope, response_id = self._requested(request)
        return self._entry(scope, response_id, None)

    def _entry(self, scope: str, response_id: str, param: str | None) -> StoredResponse:
        assert self._stored is not None  # asked only of a gateway that stores
        entry = self._stored.store.get(scope, response_id)
        if entry is None:
            raise openai_stored.ResponseNotFound(response_id, param)
        return entry


def _add_to_conversation(store: ResponseStore, scope: str, conversation_id: str, items: tuple[dict, ...]) -> None:
    conversation = store.get_conversation(scope, conversation_id)
    if conversation is None:
        log.info("conversation %s is gone: a response's items were not added to it", conversation_id)
        return
    if not store.put(scope, conversation_id, with_items(conversation, items)):
        log.warning("conversation %s would be too large for the store: a response's items were not added",
                    conversation_id)


async def streamed(request: web.Request, events: EventLog, starting_after: int) -> web.StreamResponse:
    """The events after `starting_after` as server-sent events, each as it comes, until the Response
    ends. A reader that falls behind past the events still kept gets an `error` event where the hole
    would be, and the end: never a stream with a hole in it."""
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(request)
    position = starting_after
    try:
        async for sequence, data in events.follow(starting_after):
            await response.write(data)
            position = sequence
    except EventsGone as gone:
        error = {"type": "error", "code": "events_dropped", "message": str(gone), "param": "starting_after",
                 "sequence_number": position + 1}
        await response.write(b"event: error\ndata: " + json.dumps(error).encode() + b"\n\n")
    await response.write_eof()
    return response


def _path_response_id(request: web.Request) -> str:
    return openai_stored.response_id_of(request.match_info["response_id"], "response_id")
