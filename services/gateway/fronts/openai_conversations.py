"""OpenAI's Conversations API in its own shapes (docs/clients.md, "Conversations"): a conversation is
an id, a creation time, metadata and a list of items, kept in the stored Responses' store
(response_store.py) under the tenant that created it. Pure: no I/O; ids and times are handed in.

Items are what a Responses `input` holds (messages, function calls and their outputs, reasoning),
checked as `input` is and given ids as a stored Response's input items are (openai_stored.input_items);
up to 20 are added at a time, as OpenAI allows. A Response created with `conversation` continues from
the conversation's items, and its input and output items are added to it once it completes
(openai_stored_http.py): openai_stored.conversation_param reads that parameter.

A conversation is kept whole, as one entry: every change puts it again, so it lives the store's TTL
from its last change and counts its JSON bytes against the store's bound. A change that would make it
larger than the whole bound is refused (`TooLarge`) and leaves it as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from services.common import errors
from services.gateway.fronts import openai_responses, openai_stored
from services.gateway.fronts.openai_params import BadParameter, json_object, shown
from services.gateway.fronts.response_store import StoredConversation

MAX_ITEMS_ADDED = 20  # per request, as OpenAI allows
_WHY_NOT_FOUND = ("conversations are kept for their own tenant, on the gateway that created them, until deleted, "
                  "expired (the store's TTL from their last change) or pushed out by newer entries")


class ConversationNotFound(errors.NotFound):
    """No conversation by that id for this caller: never created, another tenant's, deleted, expired or
    pushed out. One message for all, so ids say nothing across tenants; `param` names where it was sent."""

    def __init__(self, conversation_id: str, param: str | None = None, why: str = _WHY_NOT_FOUND) -> None:
        super().__init__(f"conversation with id '{conversation_id}' not found ({why})")
        self.param = param


class ConversationItemNotFound(errors.NotFound):
    def __init__(self, conversation_id: str, item_id: str) -> None:
        super().__init__(f"item with id '{item_id}' not found in conversation '{conversation_id}'")
        self.param = "item_id"


class TooLarge(BadParameter):
    """A change that would make the conversation larger than the store's whole bound."""

    def __init__(self, conversation_id: str, param: str | None) -> None:
        super().__init__(param, f"conversation '{conversation_id}' would be too large to keep in this gateway's store "
                                f"({openai_stored.STORE_FLAG}); it was left as it was")


# -- requests ---------------------------------------------------------------------------------------


def created(body: Any, conversation_id: str, created_s: int, request_id: str,
            find_item: Callable[[str], dict | None]) -> StoredConversation:
    """POST /v1/conversations: `metadata` and up to 20 `items` (both optional)."""
    body = json_object(body)
    metadata = _metadata(body.get("metadata"))
    value = body.get("items")
    items = () if value is None or value == [] else added_items(value, request_id, find_item)
    return _entry({"id": conversation_id, "object": "conversation", "created_at": created_s, "metadata": metadata},
                  items)


def updated(entry: StoredConversation, body: Any) -> StoredConversation:
    """POST /v1/conversations/{id}: `metadata` (required; null clears it) replaces the metadata."""
    body = json_object(body)
    if "metadata" not in body:
        raise BadParameter("metadata", "metadata is required: the conversation's new metadata (null clears it)")
    return _entry({**entry.conversation, "metadata": _metadata(body["metadata"])}, entry.conversation_items)


def added_items(value: Any, request_id: str, find_item: Callable[[str], dict | None]) -> tuple[dict, ...]:
    """`items` as added: 1 to 20 input items, checked as a Responses `input` is (item_reference items
    resolved to the caller's stored items), each with an id."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ITEMS_ADDED:
        raise BadParameter("items", f"items must be a list of 1 to {MAX_ITEMS_ADDED} input items, got {shown(value)}")
    try:
        resolved = openai_stored.resolved_input(value, find_item)
        openai_responses.check_input(resolved)
    except BadParameter as err:
        raise _as_items(err) from None
    except openai_stored.ItemNotFound as err:
        err.param = _items_param(err.param)
        raise
    return openai_stored.input_items(resolved, request_id)


def with_items(entry: StoredConversation, items: tuple[dict, ...]) -> StoredConversation:
    """The conversation with `items` added after its own."""
    return StoredConversation(entry.conversation, entry.conversation_items + items,
                              entry.size_bytes + openai_stored.size_bytes(items))


def without_item(entry: StoredConversation, item_id: str) -> StoredConversation:
    """DELETE /v1/conversations/{id}/items/{item_id}: the conversation without that item."""
    item(entry, item_id)
    return _entry(entry.conversation, tuple(i for i in entry.conversation_items if i["id"] != item_id))


def items_bytes(entry: StoredConversation) -> int:
    """What the conversation's items count, as a turn that continues it counts them (openai_stored.Chain)."""
    return entry.size_bytes - openai_stored.size_bytes((entry.conversation,))


# -- answers ----------------------------------------------------------------------------------------


def item(entry: StoredConversation, item_id: str) -> dict:
    """GET /v1/conversations/{id}/items/{item_id}: the item."""
    for found in entry.conversation_items:
        if found["id"] == item_id:
            return found
    raise ConversationItemNotFound(entry.conversation["id"], item_id)


def items_page(entry: StoredConversation, query: Mapping[str, str]) -> dict:
    """GET /v1/conversations/{id}/items: `limit` (1..100, 20), `order` (desc, the default, or asc), `after`."""
    return openai_stored.items_page(entry.conversation_items, query, "item",
                                    f"conversation '{entry.conversation['id']}'")


def added(items: tuple[dict, ...]) -> dict:
    """POST /v1/conversations/{id}/items: the items added, as a list object."""
    return {"object": "list", "data": list(items), "first_id": items[0]["id"], "last_id": items[-1]["id"],
            "has_more": False}


def deleted(conversation_id: str) -> dict:
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


def _entry(conversation: dict, items: tuple[dict, ...]) -> StoredConversation:
    return StoredConversation(conversation, items, openai_stored.size_bytes((conversation, *items)))


def _metadata(value: Any) -> dict:
    openai_responses.check_metadata(value)
    return dict(value or {})


def _as_items(err: BadParameter) -> BadParameter:
    """A refusal of `input` (as the Responses checks name it) under the name `items`."""
    return type(err)(_items_param(err.param), err.message.replace("input[", "items["))


def _items_param(param: str | None) -> str:
    return "items" + (param or "input")[len("input"):]
