"""The Conversations API's HTTP side (the gateway's --responses-store-bytes): POST /v1/conversations,
GET / POST (metadata) / DELETE /v1/conversations/{id}, GET / POST /v1/conversations/{id}/items and
GET / DELETE /v1/conversations/{id}/items/{item_id} (openai_http.py routes them and writes them, or
their refusals). Thin over openai_conversations.py (OpenAI's shapes) and response_store.py (the memory,
shared with the stored Responses).

As for stored Responses, every call is the caller's tenant's: authenticated first, and another
tenant's conversation is not found, as an unknown one is. Without storing, creating one is a 400 and
a well-formed id is not found, each saying storing is off.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.gateway.fronts import openai_conversations, openai_stored
from services.gateway.fronts.caller import http_authorization
from services.gateway.fronts.openai_params import BadParameter
from services.gateway.fronts.openai_stored_http import StoredResponses
from services.gateway.fronts.response_store import ResponseStore, StoredConversation
from services.gateway.tenants.credentials import Authorization

ReadBody = Callable[[web.Request], Awaitable[object]]  # the request's JSON body; a 400 when it is not JSON
Answer = Callable[[web.Request], Awaitable[dict]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ConversationsFront:
    def __init__(self, stored: StoredResponses | None, authenticate: Callable[[Authorization], object],
                 read_body: ReadBody, clock: Callable[[], float] = time.time) -> None:
        """stored: none when the gateway stores nothing. authenticate: the tenants' own check, for the
        refusals of a gateway that stores nothing."""
        self._stored = stored
        self._authenticate = authenticate
        self._read_body = read_body
        self._clock = clock

    def routes(self, wrap: Callable[[Answer], Handler]) -> list[web.RouteDef]:
        """`wrap`: makes an answer a handler (JSON, or the refusal in OpenAI's error shape)."""
        base, item = "/v1/conversations/{conversation_id}", "/v1/conversations/{conversation_id}/items/{item_id}"
        return [web.post("/v1/conversations", wrap(self.create)), web.get(base, wrap(self.retrieve)),
                web.post(base, wrap(self.update)), web.delete(base, wrap(self.delete)),
                web.get(base + "/items", wrap(self.list_items)), web.post(base + "/items", wrap(self.add_items)),
                web.get(item, wrap(self.retrieve_item)), web.delete(item, wrap(self.delete_item))]

    async def create(self, request: web.Request) -> dict:
        store, scope = self._scope(request)
        if store is None:
            raise BadParameter(None, f"conversations are not supported: {openai_stored.STORING_OFF}")
        conversation_id = "conv_" + uuid.uuid4().hex
        entry = openai_conversations.created(await self._read_body(request), conversation_id, int(self._clock()),
                                             uuid.uuid4().hex, lambda item_id: store.find_item(scope, item_id))
        _put(store, scope, entry, "items")
        return entry.conversation

    async def retrieve(self, request: web.Request) -> dict:
        _, _, entry = self._requested(request)
        return entry.conversation

    async def update(self, request: web.Request) -> dict:
        body = await self._body(request)
        store, scope, entry = self._requested(request)
        changed = openai_conversations.updated(entry, body)
        _put(store, scope, changed, "metadata")
        return changed.conversation

    async def delete(self, request: web.Request) -> dict:
        """Responses created in it keep their own context."""
        store, scope, entry = self._requested(request)
        store.delete(scope, entry.conversation["id"])
        return openai_conversations.deleted(entry.conversation["id"])

    async def list_items(self, request: web.Request) -> dict:
        _, _, entry = self._requested(request)
        return openai_conversations.items_page(entry, request.query)

    async def add_items(self, request: web.Request) -> dict:
        body = await self._body(request)
        store, scope, entry = self._requested(request)
        if not isinstance(body, dict):
            raise BadParameter(None, "the request body must be a JSON object")
        items = openai_conversations.added_items(body.get("items"), uuid.uuid4().hex,
                                                 lambda item_id: store.find_item(scope, item_id))
        _put(store, scope, openai_conversations.with_items(entry, items), "items")
        return openai_conversations.added(items)

    async def retrieve_item(self, request: web.Request) -> dict:
        _, _, entry = self._requested(request)
        return openai_conversations.item(entry, request.match_info["item_id"])

    async def delete_item(self, request: web.Request) -> dict:
        """The conversation, as OpenAI answers it, without the item."""
        store, scope, entry = self._requested(request)
        changed = openai_conversations.without_item(entry, request.match_info["item_id"])
        _put(store, scope, changed, None)
        return changed.conversation

    async def _body(self, request: web.Request) -> object:
        """The body of a change, read once the caller is authenticated and before the conversation is looked
        up, so no change made while it arrives is lost (the lookup and the put run with no await between)."""
        self._scope(request)
        return await self._read_body(request)

    def _scope(self, request: web.Request) -> tuple[ResponseStore | None, str]:
        """The store (none: storing is off) and the caller's scope, once the caller is authenticated."""
        authorization = http_authorization(request)
        if self._stored is None:
            self._authenticate(authorization)
            return None, ""
        return self._stored.store, self._stored.scope_of(authorization)

    def _requested(self, request: web.Request) -> tuple[ResponseStore, str, StoredConversation]:
        """The store, the caller's scope and the conversation in the path."""
        store, scope = self._scope(request)
        conversation_id = openai_stored.conversation_id_of(request.match_info["conversation_id"], "conversation_id")
        if store is None:
            raise openai_conversations.ConversationNotFound(conversation_id, why=openai_stored.STORING_OFF)
        entry = store.get_conversation(scope, conversation_id)
        if entry is None:
            raise openai_conversations.ConversationNotFound(conversation_id, "conversation_id")
        return store, scope, entry


def _put(store: ResponseStore, scope: str, entry: StoredConversation, param: str | None) -> None:
    """Keeps the conversation as changed; a 400 naming `param` (it is left as it was) when it cannot fit."""
    if not store.put(scope, entry.conversation["id"], entry):
        raise openai_conversations.TooLarge(entry.conversation["id"], param)
