"""The stored Responses' bound (services/gateway/fronts/response_store.py): bytes with the least recently
used out first, a time to live from when each was put, and scopes that never see each other's. A fake
clock drives expiry."""

from __future__ import annotations

import pytest

from services.gateway.fronts.response_store import (
    DropReason,
    EntryKind,
    ResponseStore,
    StoredConversation,
    StoredResponse,
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_store(max_bytes: int = 100, ttl_s: float = 60.0) -> tuple[ResponseStore, FakeClock]:
    clock = FakeClock()
    return ResponseStore(max_bytes, ttl_s, clock), clock


def entry(size_bytes: int, name: str = "r") -> StoredResponse:
    return StoredResponse({"id": name}, (), size_bytes)


def test_a_put_response_is_found_under_its_scope_only():
    store, _ = make_store()
    assert store.put("alpha", "resp_1", entry(10))
    assert store.get("alpha", "resp_1") == entry(10)
    assert store.get("beta", "resp_1") is None
    assert not store.delete("beta", "resp_1")
    assert store.get("alpha", "resp_1") is not None


def test_a_full_store_pushes_out_the_least_recently_used_first():
    store, _ = make_store(max_bytes=30)
    for name in ("resp_a", "resp_b", "resp_c"):
        store.put("t", name, entry(10, name))
    store.get("t", "resp_a")  # now b is the least recently used
    store.put("t", "resp_d", entry(10, "resp_d"))
    assert [store.get("t", n) is not None for n in ("resp_a", "resp_b", "resp_c", "resp_d")] == [True, False, True,
                                                                                                 True]
    assert (store.num_bytes, store.num_responses) == (30, 3)


def test_a_large_response_pushes_out_as_many_as_it_needs():
    store, _ = make_store(max_bytes=30)
    for name in ("resp_a", "resp_b", "resp_c"):
        store.put("t", name, entry(10, name))
    store.put("t", "resp_big", entry(25, "resp_big"))
    assert (store.num_responses, store.num_bytes) == (1, 25)


def test_a_response_larger_than_the_whole_bound_is_not_kept_and_pushes_nothing_out():
    store, _ = make_store(max_bytes=30)
    store.put("t", "resp_a", entry(10))
    assert not store.can_put(31)
    assert not store.put("t", "resp_huge", entry(31))
    assert store.get("t", "resp_huge") is None and store.get("t", "resp_a") is not None
    assert store.num_bytes == 10


def test_responses_expire_their_ttl_after_being_put_even_if_read():
    store, clock = make_store(ttl_s=60)
    store.put("t", "resp_a", entry(10))
    clock.now_s += 30
    store.put("t", "resp_b", entry(10))
    clock.now_s += 29.9
    assert store.get("t", "resp_a") is not None  # read: still expires at its own time
    clock.now_s += 0.1
    assert store.get("t", "resp_a") is None
    assert store.get("t", "resp_b") is not None
    clock.now_s += 30
    assert store.get("t", "resp_b") is None
    assert (store.num_bytes, store.num_responses) == (0, 0)


def test_putting_again_under_the_same_id_replaces_and_restarts_its_ttl():
    store, clock = make_store(max_bytes=30, ttl_s=60)
    store.put("t", "resp_a", entry(10))
    clock.now_s += 50
    store.put("t", "resp_a", entry(20))
    clock.now_s += 50
    assert store.get("t", "resp_a") == entry(20)
    assert store.num_bytes == 20


def test_delete_frees_its_bytes_and_answers_whether_there_was_one():
    store, _ = make_store()
    store.put("t", "resp_a", entry(10))
    assert store.delete("t", "resp_a")
    assert not store.delete("t", "resp_a")
    assert (store.num_bytes, store.num_responses) == (0, 0)


def test_what_leaves_without_a_delete_is_told_with_why():
    dropped: list[DropReason] = []
    clock = FakeClock()
    store = ResponseStore(30, 60.0, clock, on_dropped=lambda reason, kind: dropped.append(reason))
    store.put("t", "resp_a", entry(20))
    store.put("t", "resp_b", entry(20))  # pushes a out
    store.put("t", "resp_huge", entry(31))
    store.delete("t", "resp_b")  # asked for: not a drop
    store.put("t", "resp_c", entry(10))
    clock.now_s += 60
    store.get("t", "resp_c")
    assert dropped == [DropReason.PUSHED_OUT, DropReason.TOO_LARGE, DropReason.EXPIRED]


@pytest.mark.parametrize(("max_bytes", "ttl_s", "message"), [
    (0, 60.0, "max_bytes must be > 0, got 0"),
    (100, 0.0, "ttl_s must be > 0, got 0.0"),
])
def test_bounds_must_be_positive(max_bytes, ttl_s, message):
    with pytest.raises(ValueError, match=message):
        ResponseStore(max_bytes, ttl_s)


def _with_items(name: str, context_ids: tuple[str, ...], output_ids: tuple[str, ...] = ()) -> StoredResponse:
    context = tuple({"id": i, "type": "message", "role": "user", "content": i} for i in context_ids)
    output = [{"id": i, "type": "message", "role": "assistant", "content": i} for i in output_ids]
    return StoredResponse({"id": name, "output": output}, context, 10)


def test_an_item_is_found_by_its_id_in_its_scope_only_among_inputs_and_outputs():
    store, _ = make_store()
    store.put("alpha", "resp_1", _with_items("resp_1", ("msg_in",), ("msg_out",)))
    assert store.find_item("alpha", "msg_in")["content"] == "msg_in"
    assert store.find_item("alpha", "msg_out")["role"] == "assistant"
    assert store.find_item("beta", "msg_in") is None
    assert store.find_item("alpha", "msg_none") is None


def test_an_item_held_by_several_responses_is_found_until_the_last_of_them_goes():
    store, clock = make_store(max_bytes=30, ttl_s=60)
    store.put("alpha", "resp_1", _with_items("resp_1", ("msg_a",)))
    clock.now_s += 10
    store.put("alpha", "resp_2", _with_items("resp_2", ("msg_a", "msg_b")))  # a chain repeats its context
    store.delete("alpha", "resp_2")
    assert store.find_item("alpha", "msg_a") is not None and store.find_item("alpha", "msg_b") is None
    clock.now_s += 55  # resp_1 expires
    assert store.find_item("alpha", "msg_a") is None
    for name in ("resp_3", "resp_4", "resp_5", "resp_6"):  # resp_3 is pushed out by resp_6
        store.put("alpha", name, _with_items(name, (f"msg_{name}",)))
    assert store.find_item("alpha", "msg_resp_3") is None and store.find_item("alpha", "msg_resp_6") is not None
    assert store._items.keys() == {("alpha", f"msg_resp_{n}") for n in (4, 5, 6)}  # the index holds no stale id


def conversation(size_bytes: int, *item_ids: str) -> StoredConversation:
    return StoredConversation({"id": "conv"}, tuple({"id": i} for i in item_ids), size_bytes)


def test_conversations_share_the_bound_and_are_found_only_as_conversations():
    store, _ = make_store(max_bytes=30)
    store.put("t", "resp_a", entry(10))
    store.put("t", "conv_a", conversation(10))
    assert (store.num_responses, store.num_conversations, store.num_bytes) == (1, 1, 20)
    assert store.get("t", "conv_a") is None and store.get_conversation("t", "resp_a") is None
    assert store.get_conversation("t", "conv_a") == conversation(10)
    assert store.get_conversation("u", "conv_a") is None
    store.put("t", "resp_b", entry(15))  # pushes out resp_a, the least recently used
    assert (store.num_responses, store.num_conversations, store.num_bytes) == (1, 1, 25)
    assert store.delete("t", "conv_a")
    assert (store.num_conversations, store.num_bytes) == (0, 15)


def test_a_changed_conversation_is_put_again_and_lives_its_ttl_from_then():
    store, clock = make_store(ttl_s=60.0)
    store.put("t", "conv_a", conversation(10, "msg_1"))
    clock.now_s += 50
    assert store.put("t", "conv_a", conversation(20, "msg_1", "msg_2"))
    assert (store.num_conversations, store.num_bytes) == (1, 20)
    clock.now_s += 50  # 100 s after it was created, 50 after its change
    assert store.find_item("t", "msg_2") == {"id": "msg_2"}
    clock.now_s += 10
    assert store.get_conversation("t", "conv_a") is None and store.find_item("t", "msg_1") is None


def test_a_change_too_large_for_the_bound_leaves_the_conversation_as_it_was():
    store, _ = make_store(max_bytes=30)
    store.put("t", "conv_a", conversation(10, "msg_1"))
    assert not store.put("t", "conv_a", conversation(31, "msg_1", "msg_2"))
    assert store.get_conversation("t", "conv_a") == conversation(10, "msg_1")
    assert store.find_item("t", "msg_2") is None


def test_drops_say_which_kind_left():
    dropped: list[tuple[DropReason, EntryKind]] = []
    store = ResponseStore(30, 60.0, FakeClock(), on_dropped=lambda reason, kind: dropped.append((reason, kind)))
    store.put("t", "conv_a", conversation(20))
    store.put("t", "resp_b", entry(20))
    store.put("t", "conv_c", conversation(31))
    assert dropped == [(DropReason.PUSHED_OUT, EntryKind.CONVERSATION), (DropReason.TOO_LARGE, EntryKind.CONVERSATION)]
