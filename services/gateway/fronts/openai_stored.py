"""Stored Responses in OpenAI's shapes (the gateway's --responses-store-bytes; docs/clients.md, "Stored
responses"): what a stored Response keeps, how a later turn continues it (`previous_response_id`), and
the answers of GET /v1/responses/{id}/input_items and DELETE /v1/responses/{id}. Pure: no I/O; the
store itself is response_store.py.

A stored Response keeps its context: every input item that produced it, the earlier turns' first (their
inputs and outputs, as `previous_response_id` prepended them), each with an id. A turn that names it
continues from that context plus its output, so a chain is one lookup however long it grew, and
deleting or losing an earlier turn never breaks a later one. `instructions` are not carried over, as
OpenAI documents: each turn sends its own. The context counts against the store's bound whole (its
JSON bytes), though a chain's turns share their items' objects in memory.

An `item_reference` input item (`{"type": "item_reference", "id": ...}`, the type may be left out)
names an item the caller's tenant has stored, an input or an output item of any kept Response; it is
replaced by that item before anything else reads the input (`resolved_input`), so the model, the
kept context and input_items all see the item itself.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common import errors
from services.gateway.fronts.openai_params import BadParameter, shown
from services.gateway.fronts.response_event_log import EventLog
from services.gateway.fronts.response_store import StoredResponse

STORE_FLAG = "--responses-store-bytes (INFERMESH_GATEWAY_RESPONSES_STORE_BYTES)"
STORING_OFF = f"this gateway stores no responses (storing is off: its operator turns it on with {STORE_FLAG})"
# Ours are resp_ and 32 hex digits; anything of this shape is looked up (and not found), anything else is a 400.
_RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9_-]{1,128}")
_CONVERSATION_ID = re.compile(r"conv_[A-Za-z0-9_-]{1,128}")  # ours: conv_ and 32 hex digits
_MAX_ITEMS_PAGE = 100
_DEFAULT_ITEMS_PAGE = 20
_WHY_NOT_FOUND = ("responses are kept for their own tenant, on the gateway that answered them, until deleted, "
                  "expired or pushed out by newer ones")
_WHY_ITEM_NOT_FOUND = ("an item_reference names an input or output item of a response kept for its own tenant, "
                       "on the gateway that answered it, until deleted, expired or pushed out by newer ones")
_CONTINUED = ("completed", "incomplete")
_NOT_CONTINUED = {
    "failed": "failed, so it has no output to continue from: send previous_response_id of the turn before it",
    "cancelled": "was cancelled, so it has no output to continue from: send previous_response_id of the turn "
                 "before it",
    "queued": "is still running in the background: poll GET /v1/responses/{id} until it is done",
    "in_progress": "is still running in the background: poll GET /v1/responses/{id} until it is done",
}
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class ResponseNotFound(errors.NotFound):
    """No stored response by that id for this caller: never stored, another tenant's, deleted, expired or
    pushed out. One message for all, so ids say nothing across tenants; `param` names where it was sent."""

    def __init__(self, response_id: str, param: str | None = None, why: str = _WHY_NOT_FOUND) -> None:
        super().__init__(f"response with id '{response_id}' not found ({why})")
        self.param = param


class ItemNotFound(errors.NotFound):
    """No stored item by that id for this caller (as ResponseNotFound: one message, whatever the reason)."""

    def __init__(self, item_id: str, param: str) -> None:
        super().__init__(f"item with id '{item_id}' not found ({_WHY_ITEM_NOT_FOUND})")
        self.param = param


@dataclass(frozen=True)
class Chain:
    """What a turn that names a stored response continues from: its context, then its output."""

    items: tuple[dict, ...] = ()
    size_bytes: int = 0  # the items' JSON, as the store counts it


def response_id_of(value: Any, param: str) -> str:
    """A response id as sent (a path segment or previous_response_id), checked for shape only."""
    if not isinstance(value, str) or not _RESPONSE_ID.fullmatch(value):
        raise BadParameter(param, f"{param} must be a response id (resp_ and up to 128 letters, digits, _ or -), "
                                  f"got {shown(value)}")
    return value


def conversation_id_of(value: Any, param: str) -> str:
    """A conversation id as sent (a path segment or `conversation`), checked for shape only."""
    if not isinstance(value, str) or not _CONVERSATION_ID.fullmatch(value):
        raise BadParameter(param, f"{param} must be a conversation id (conv_ and up to 128 letters, digits, _ or -), "
                                  f"got {shown(value)}")
    return value


def conversation_param(body: dict) -> str | None:
    """POST /v1/responses' `conversation` (an id, or an object with its id); a 400 beside
    previous_response_id, as OpenAI answers: a turn continues one or the other."""
    value = body.get("conversation")
    if value is None:
        return None
    if body.get("previous_response_id") is not None:
        raise BadParameter("conversation", "conversation and previous_response_id are mutually exclusive: send one "
                                           "of them")
    if isinstance(value, dict):
        return conversation_id_of(value.get("id"), "conversation.id")
    return conversation_id_of(value, "conversation")


def previous_response_id(body: dict) -> str | None:
    value = body.get("previous_response_id")
    return None if value is None else response_id_of(value, "previous_response_id")


def wants_store(body: dict) -> bool:
    """`store` as sent; true when absent, as OpenAI defaults it."""
    store = body.get("store", True)
    if store is None:
        return True
    if not isinstance(store, bool):
        raise BadParameter("store", f"store must be true or false, got {shown(store)}")
    return store


def is_item_reference(item: Any) -> bool:
    """An item_reference input item: typed so, or (as OpenAI's type allows) an object holding only an id."""
    return isinstance(item, dict) and (item.get("type") == "item_reference" or ("type" not in item and
                                                                             set(item) == {"id"}))


def resolved_input(value: Any, find_item: Callable[[str], dict | None]) -> Any:
    """`input` with each item_reference replaced by the stored item it names (`find_item`: the caller's
    tenant's item by id, None when it has none). Anything else is left for chat_request to check."""
    if not isinstance(value, list) or not any(is_item_reference(item) for item in value):
        return value
    return [_referenced(item, i, find_item) if is_item_reference(item) else item for i, item in enumerate(value)]


def _referenced(reference: dict, i: int, find_item: Callable[[str], dict | None]) -> dict:
    item_id = reference.get("id")
    if not isinstance(item_id, str) or not item_id:
        raise BadParameter(f"input[{i}].id", f"input[{i}].id must be the id of a stored item, got {shown(item_id)}")
    item = find_item(item_id)
    if item is None:
        raise ItemNotFound(item_id, f"input[{i}].id")
    return dict(item)


def chain_of(previous: StoredResponse) -> Chain:
    """The items a turn naming `previous` continues from: only a finished one's (completed, or incomplete
    at its token limit). A failed or cancelled one's output is what it got to before it ended, and a
    background one still running has none yet."""
    response = previous.response
    if response["status"] not in _CONTINUED:
        raise BadParameter("previous_response_id", f"response '{response['id']}' {_NOT_CONTINUED[response['status']]}")
    output = tuple(response["output"])
    return Chain(previous.context + output, _context_bytes(previous) + size_bytes(output))


def input_items(value: Any, request_id: str) -> tuple[dict, ...]:
    """A request's `input` (already checked by openai_responses.chat_request) as the items input_items
    lists: a string is one user message, string content becomes a text part, and an item without an id
    gets one (msg_, fc_, fco_ or rs_, then the request id and its index)."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    return tuple(_input_item(item, f"{request_id}_{i}") for i, item in enumerate(items))


def stored_response(response: dict, chain: Chain, items: tuple[dict, ...],
                    events: EventLog | None = None) -> StoredResponse:
    """What the store keeps of a Response answered after `chain`, for this turn's input `items` (and, for
    a background stream, its events as far as they came)."""
    context = chain.items + items
    num_bytes = size_bytes((response,)) + chain.size_bytes + size_bytes(items)
    return StoredResponse(response, context, num_bytes + (events.num_bytes if events else 0), events)


def stream_query(query: Mapping[str, str]) -> int | None:
    """GET /v1/responses/{id}'s `stream` and `starting_after`: the sequence number to stream after (-1:
    from the first event), or None when the Response is not to be streamed."""
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false"):
        raise BadParameter("stream", f"stream must be true or false, got {shown(query['stream'])}")
    after = query.get("starting_after")
    if stream == "false":
        if after is not None:
            raise BadParameter("starting_after", "starting_after is for streaming: send it with stream=true")
        return None
    if after is None:
        return -1
    if not after.isdigit() or len(after) > 18:
        raise BadParameter("starting_after", f"starting_after must be an event's sequence_number (an integer "
                                             f">= 0), got {shown(after)}")
    return int(after)


def replayed_events(entry: StoredResponse) -> EventLog:
    """The events a GET with stream=true replays; a 400 naming `stream` when there are none to replay."""
    if entry.events is None:
        raise BadParameter("stream", f"response '{entry.response['id']}' has no events to stream: only a Response "
                                     "created with background: true and stream: true keeps them, while they fit in "
                                     f"this gateway's store ({STORE_FLAG}); GET it without stream")
    return entry.events


def too_large(response: dict) -> dict:
    """A background Response that ended too large for the store, as its poller finds it: failed, saying so."""
    message = f"the response was too large to keep in this gateway's store ({STORE_FLAG})"
    return {**response, "status": "failed", "output": [], "incomplete_details": None,
            "error": {"code": "server_error", "message": message}}


def input_items_page(entry: StoredResponse, query: Mapping[str, str]) -> dict:
    """GET /v1/responses/{id}/input_items: a list object of the context's items."""
    return items_page(entry.context, query, "input item", "this response")


def items_page(items: Sequence[dict], query: Mapping[str, str], what: str, where: str) -> dict:
    """A list object of `items` (oldest first; each with an id). `limit` 1..100 (20), `order` desc (the
    default, newest first) or asc, `after` / `before` an item id of the list (`what`, in `where`)."""
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise BadParameter("order", f"order must be asc or desc, got {shown(order)}")
    listed = list(items) if order == "asc" else list(reversed(items))
    if query.get("after") is not None:
        listed = listed[_position(listed, query["after"], "after", what, where) + 1:]
    if query.get("before") is not None:
        listed = listed[:_position(listed, query["before"], "before", what, where)]
    page = listed[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(listed) > limit}


def deleted(response_id: str) -> dict:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _input_item(item: dict, suffix: str) -> dict:
    kind = item.get("type", "message")
    stored = {"type": kind, **item}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        stored["content"] = [{"type": part, "text": item["content"]}]
    stored.setdefault("status", "completed")
    if not isinstance(stored.get("id"), str):
        stored["id"] = f"{_ITEM_ID_PREFIX.get(kind, 'item')}_{suffix}"
    return stored


def _limit(value: str | None) -> int:
    if value is None:
        return _DEFAULT_ITEMS_PAGE
    if not value.isdigit() or not 1 <= int(value) <= _MAX_ITEMS_PAGE:
        raise BadParameter("limit", f"limit must be an integer from 1 to {_MAX_ITEMS_PAGE}, got {shown(value)}")
    return int(value)


def _position(items: list[dict], item_id: str, param: str, what: str, where: str) -> int:
    for i, item in enumerate(items):
        if item["id"] == item_id:
            return i
    raise BadParameter(param, f"{param}: no {what} with id {shown(item_id)} in {where}")


def _context_bytes(entry: StoredResponse) -> int:
    return entry.size_bytes - size_bytes((entry.response,))


def size_bytes(values: Sequence[dict]) -> int:
    """What `values` count against the store's bound: their JSON bytes."""
    return sum(len(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()) for v in values)
