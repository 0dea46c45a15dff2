"""Stored Responses and Conversations: a bounded in-memory map from (scope, id) to what a later turn or
a GET needs (openai_stored.py and openai_conversations.py say what that is, in OpenAI's shapes). Both
kinds share one bound and one policy; their ids never collide (resp_ and conv_). Pure: no I/O; the clock
is injected.

Bounded twice. By bytes: a response that does not fit pushes out the least recently used ones (a
GET, a chained turn or an input-items read counts as a use) until it does; one larger than the
whole bound is not kept, and `put` says so. By age: each entry lives `ttl_s` from when it was put,
read or not (OpenAI, too, keeps a response for a fixed time from its creation). A conversation is put
again each time it changes, so it lives `ttl_s` from its last change (OpenAI keeps conversations without
a TTL; a bounded gateway cannot).

Scoped: an entry is found only under the scope (the tenant) that put it, so another scope's lookup
misses exactly as an unknown or expired id does, and ids say nothing across tenants. So is an item
(an input or output item, by its own id: what an `item_reference` names): `find_item` looks only
through the scope's entries, by an index kept beside them.

What leaves without being deleted is told to `on_dropped` with why (DropReason) and what it was
(EntryKind), for the metrics.

Invariant: `_by_use` and `_by_expiry` hold the same keys, and `num_bytes`, the sum of their entries'
sizes, never exceeds `max_bytes`; `_items` names, for each (scope, item id), exactly the kept entries
of that scope that hold an item with that id. The TTL is one for all, so the order entries were put in is the
order they expire in: `_by_expiry` is that order, and expiring is popping its head (O(1) each).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.fronts.response_event_log import EventLog

Key = tuple[str, str]  # (scope, response or conversation id)


class EntryKind(enum.Enum):
    RESPONSE = "response"
    CONVERSATION = "conversation"


class DropReason(enum.Enum):
    EXPIRED = "expired"  # its TTL passed
    PUSHED_OUT = "pushed_out"  # the least recently used, out for a newer one
    TOO_LARGE = "too_large"  # never kept: larger than the whole bound


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as answered (JSON-able): a GET returns it
    context: tuple[dict, ...]  # the input items that produced it, earlier turns' first: input_items lists them
    size_bytes: int  # what it counts against the bound (openai_stored.stored_response measures it)
    # A background stream's events (GET ?stream=true replays them); None when it was not streamed, or its
    # events did not fit beside it. Counted in size_bytes as far as they had come when it was put.
    events: EventLog | None = None

    def items(self) -> tuple[dict, ...]:
        """Every item an item_reference may name: its context's, then its output's."""
        return self.context + tuple(self.response.get("output") or ())


@dataclass(frozen=True)
class StoredConversation:
    """A conversation as it stands: replaced whole (put again) when it changes."""

    conversation: dict  # the Conversation object (id, created_at, metadata): a GET returns it
    conversation_items: tuple[dict, ...]  # its items, oldest first, each with an id
    size_bytes: int  # what it counts against the bound (openai_conversations measures it)

    def items(self) -> tuple[dict, ...]:
        return self.conversation_items


Entry = StoredResponse | StoredConversation


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 on_dropped: Callable[[DropReason, EntryKind], None] = lambda reason, kind: None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_dropped = on_dropped
        self._by_use: OrderedDict[Key, Entry] = OrderedDict()  # least recently used first
        self._by_expiry: OrderedDict[Key, float] = OrderedDict()  # key -> expiry time, soonest first
        self._items: dict[Key, dict[str, None]] = {}  # (scope, item id) -> the response ids holding it, oldest first
        self.num_bytes = 0
        self.num_conversations = 0

    @property
    def num_responses(self) -> int:
        return len(self._by_use) - self.num_conversations

    def can_put(self, size_bytes: int) -> bool:
        """Whether an entry this large can be kept at all (after pushing out every other)."""
        return size_bytes <= self.max_bytes

    def put(self, scope: str, response_id: str, entry: Entry) -> bool:
        """Keeps `entry` (replacing one under the same key), pushing out the least recently used ones
        it needs room from; False, and nothing changed but expiry, when it can never fit."""
        self._expire()
        if not self.can_put(entry.size_bytes):
            self._on_dropped(DropReason.TOO_LARGE, _kind(entry))
            return False
        key = (scope, response_id)
        self._remove(key)
        while self.num_bytes + entry.size_bytes > self.max_bytes:
            oldest = next(iter(self._by_use))
            kind = _kind(self._by_use[oldest])
            self._remove(oldest)
            self._on_dropped(DropReason.PUSHED_OUT, kind)
        self._by_use[key] = entry
        self._by_expiry[key] = self._clock() + self.ttl_s
        self.num_bytes += entry.size_bytes
        self.num_conversations += isinstance(entry, StoredConversation)
        for item_id in _item_ids(entry):
            self._items.setdefault((scope, item_id), {})[response_id] = None
        return True

    def get(self, scope: str, response_id: str) -> StoredResponse | None:
        """The response, now the most recently used; None when unknown, expired, pushed out or another scope's."""
        entry = self._used(scope, response_id)
        return entry if isinstance(entry, StoredResponse) else None

    def get_conversation(self, scope: str, conversation_id: str) -> StoredConversation | None:
        """The conversation, now the most recently used; None as `get` says."""
        entry = self._used(scope, conversation_id)
        return entry if isinstance(entry, StoredConversation) else None

    def _used(self, scope: str, entry_id: str) -> Entry | None:
        self._expire()
        key = (scope, entry_id)
        entry = self._by_use.get(key)
        if entry is not None:
            self._by_use.move_to_end(key)
        return entry

    def find_item(self, scope: str, item_id: str) -> dict | None:
        """The item with this id in the scope's newest entry holding one (now the most recently used);
        None when no kept entry of this scope holds it."""
        self._expire()
        holders = self._items.get((scope, item_id))
        if not holders:
            return None
        response_id = next(reversed(holders))
        entry = self._used(scope, response_id)
        assert entry is not None  # the index names kept entries only
        return next(item for item in entry.items() if item.get("id") == item_id)

    def delete(self, scope: str, response_id: str) -> bool:
        """False when there was nothing to delete under this scope."""
        self._expire()
        return self._remove((scope, response_id))

    def _expire(self) -> None:
        now = self._clock()
        while self._by_expiry:
            key, expiry = next(iter(self._by_expiry.items()))
            if expiry > now:
                return
            kind = _kind(self._by_use[key])
            self._remove(key)
            self._on_dropped(DropReason.EXPIRED, kind)

    def _remove(self, key: Key) -> bool:
        entry = self._by_use.pop(key, None)
        if entry is None:
            return False
        del self._by_expiry[key]
        self.num_bytes -= entry.size_bytes
        self.num_conversations -= isinstance(entry, StoredConversation)
        scope, response_id = key
        for item_id in _item_ids(entry):
            holders = self._items[(scope, item_id)]
            del holders[response_id]
            if not holders:
                del self._items[(scope, item_id)]
        return True


def _kind(entry: Entry) -> EntryKind:
    return EntryKind.CONVERSATION if isinstance(entry, StoredConversation) else EntryKind.RESPONSE


def _item_ids(entry: Entry) -> set[str]:
    return {item["id"] for item in entry.items() if isinstance(item.get("id"), str)}
