"""The Conversations API's shapes (services/gateway/fronts/openai_conversations.py): what a created,
updated or changed conversation holds, what its byte count is, the answers, and the refusals, each
naming its field."""

from __future__ import annotations

import json
import re

import pytest

from services.gateway.fronts import openai_conversations as conversations
from services.gateway.fronts.openai_params import BadParameter
from services.gateway.fronts.openai_stored import ItemNotFound, conversation_param


def _json_bytes(*values: dict) -> int:
    return sum(len(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()) for v in values)


def _created(body: dict, stored: dict[str, dict] | None = None):
    return conversations.created(body, "conv_1", 7, "req", (stored or {}).get)


def test_a_created_conversation_holds_its_metadata_and_items_with_ids():
    entry = _created({"metadata": {"k": "v"}, "items": [{"role": "user", "content": "Hi"},
                                                         {"type": "message", "role": "assistant", "content": "Yo"}]})
    assert entry.conversation == {"id": "conv_1", "object": "conversation", "created_at": 7, "metadata": {"k": "v"}}
    assert [i["id"] for i in entry.items()] == ["msg_req_0", "msg_req_1"]
    assert entry.items()[1]["content"] == [{"type": "output_text", "text": "Yo"}]
    assert entry.size_bytes == _json_bytes(entry.conversation, *entry.items())
    assert conversations.items_bytes(entry) == _json_bytes(*entry.items())


def test_an_empty_create_is_a_conversation_without_items():
    entry = _created({})
    assert (entry.conversation["metadata"], entry.items()) == ({}, ())


def test_added_and_removed_items_keep_the_byte_count_exact():
    entry = _created({"items": [{"role": "user", "content": "Hi"}]})
    grown = conversations.with_items(entry, conversations.added_items([{"role": "user", "content": "And?"}], "r2",
                                                                      {}.get))
    assert grown.size_bytes == _json_bytes(grown.conversation, *grown.items())
    shrunk = conversations.without_item(grown, "msg_req_0")
    assert [i["id"] for i in shrunk.items()] == ["msg_r2_0"]
    assert shrunk.size_bytes == _json_bytes(shrunk.conversation, *shrunk.items())


def test_updated_metadata_replaces_the_old():
    entry = _created({"metadata": {"a": "1"}})
    assert conversations.updated(entry, {"metadata": {"b": "2"}}).conversation["metadata"] == {"b": "2"}
    assert conversations.updated(entry, {"metadata": None}).conversation["metadata"] == {}


def test_an_item_reference_is_replaced_by_the_item_it_names():
    stored = {"msg_9": {"id": "msg_9", "type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "Hi"}]}}
    entry = _created({"items": [{"type": "item_reference", "id": "msg_9"}]}, stored)
    assert entry.items() == (stored["msg_9"],)


def test_an_unknown_item_reference_is_a_404_naming_it_under_items():
    with pytest.raises(ItemNotFound) as caught:
        _created({"items": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_x"}]})
    assert caught.value.param == "items[1].id"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"items": "Hi"}, "items", "items must be a list of 1 to 20"),
    ({"items": [{"role": "user", "content": "x"}] * 21}, "items", "items must be a list of 1 to 20"),
    ({"items": [5]}, "items[0]", "items[0] must be an object"),
    ({"items": [{"role": "robot", "content": "x"}]}, "items[0].role", "items[0].role must be one of"),
    ({"items": [{"type": "web_search_call"}]}, "items[0].type", "items[0].type must be"),
    ({"metadata": ["k"]}, "metadata", "metadata must be an object"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
])
def test_bad_creates_are_400s_naming_the_field(body, param, message):
    with pytest.raises(BadParameter, match=re.escape(message)) as caught:
        _created(body)
    assert caught.value.param == param


def test_an_update_without_metadata_is_a_400_naming_it():
    with pytest.raises(BadParameter, match="metadata is required") as caught:
        conversations.updated(_created({}), {})
    assert caught.value.param == "metadata"


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(BadParameter, match="JSON object"):
        _created([])  # type: ignore[arg-type]


def test_items_are_paged_newest_first_by_default():
    entry = _created({"items": [{"role": "user", "content": str(i)} for i in range(3)]})
    page = conversations.items_page(entry, {"limit": "2"})
    assert ([i["id"] for i in page["data"]], page["has_more"]) == (["msg_req_2", "msg_req_1"], True)
    rest = conversations.items_page(entry, {"limit": "2", "after": page["last_id"]})
    assert ([i["id"] for i in rest["data"]], rest["has_more"]) == (["msg_req_0"], False)
    with pytest.raises(BadParameter, match="no item with id 'msg_x' in conversation 'conv_1'") as caught:
        conversations.items_page(entry, {"after": "msg_x"})
    assert caught.value.param == "after"


def test_an_unknown_item_is_a_404_naming_it():
    with pytest.raises(conversations.ConversationItemNotFound, match="msg_x") as caught:
        conversations.item(_created({}), "msg_x")
    assert caught.value.param == "item_id"


def test_answers_have_openais_object_names():
    assert conversations.deleted("conv_1") == {"id": "conv_1", "object": "conversation.deleted", "deleted": True}
    items = ({"id": "a"}, {"id": "b"})
    assert conversations.added(items) == {"object": "list", "data": list(items), "first_id": "a", "last_id": "b",
                                          "has_more": False}


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None), ({"conversation": None}, None), ({"conversation": "conv_a"}, "conv_a"),
    ({"conversation": {"id": "conv_b"}}, "conv_b"),
])
def test_the_responses_conversation_parameter_is_an_id_or_an_object_with_one(body, expected):
    assert conversation_param(body) == expected


@pytest.mark.parametrize(("body", "param"), [
    ({"conversation": "resp_a"}, "conversation"), ({"conversation": ""}, "conversation"),
    ({"conversation": {}}, "conversation.id"), ({"conversation": ["conv_a"]}, "conversation"),
    ({"conversation": "conv_a", "previous_response_id": "resp_a"}, "conversation"),
])
def test_a_bad_conversation_parameter_is_a_400_naming_it(body, param):
    with pytest.raises(BadParameter) as caught:
        conversation_param(body)
    assert caught.value.param == param
