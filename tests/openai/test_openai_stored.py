"""Stored Responses in OpenAI's shapes (services/gateway/fronts/openai_stored.py) and the chain a turn
builds from one (openai_responses.chat_request's `earlier`): what is kept, what a later turn reads, the
input items' pages and the refusals."""

from __future__ import annotations

import json

import pytest

from services.gateway.fronts import openai_codec
from services.gateway.fronts.openai_params import BadParameter
from services.gateway.fronts.openai_responses import chat_request, completed
from services.gateway.fronts.openai_stored import (
    Chain,
    ItemNotFound,
    ResponseNotFound,
    chain_of,
    deleted,
    input_items,
    input_items_page,
    is_item_reference,
    replayed_events,
    resolved_input,
    response_id_of,
    stored_response,
    stream_query,
    too_large,
)

CALL = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}


def _reply(message: dict, finish_reason: str = "stop") -> dict:
    return {"id": "chatcmpl-r", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


NO_CHAIN = Chain()


def _turn(body: dict, content: str | None, request_id: str, chain: Chain = NO_CHAIN, **message):
    """One answered turn: its request, Response and what the store keeps of it."""
    wanted = chat_request({"model": "m", **body}, storing=True, earlier=chain.items)
    response = completed(wanted, _reply({"role": "assistant", "content": content, **message}), request_id)
    return wanted, response, stored_response(response, chain, input_items(wanted.input, request_id))


def test_a_second_turn_continues_the_first_ones_input_and_output_without_its_instructions():
    _, first, kept = _turn({"input": "Hi", "instructions": "Be terse."}, "Hello.", "r1")
    second = chat_request({"model": "m", "input": "And?", "previous_response_id": "resp_r1",
                           "instructions": "Be kind."}, storing=True, earlier=chain_of(kept).items)
    assert second.chat["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And?"}]
    assert (second.echoed["previous_response_id"], second.echoed["store"]) == ("resp_r1", True)
    assert openai_codec.parse_chat(second.chat).generate.messages[2].content == "Hello."
    assert first["store"] is True and first["previous_response_id"] is None


def test_a_chain_is_one_context_however_long_and_a_tool_call_goes_back_with_its_output():
    _, _, first = _turn({"input": "The time?"}, None, "r1", tool_calls=[CALL])
    _, _, second = _turn({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "12:00"}],
                          "previous_response_id": "resp_r1"}, "Noon.", "r2", chain_of(first))
    third = chat_request({"model": "m", "input": "Thanks", "previous_response_id": "resp_r2"}, storing=True,
                         earlier=chain_of(second).items)
    assert [m["role"] for m in third.chat["messages"]] == ["user", "assistant", "tool", "assistant", "user"]
    assert third.chat["messages"][1]["tool_calls"][0]["id"] == "call_1"
    assert [item["type"] for item in second.context] == ["message", "function_call", "function_call_output"]


def test_input_items_get_ids_and_text_parts_and_keep_their_own_ids():
    items = input_items([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "id": "msg_x"},
                         {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                         {"type": "function_call_output", "call_id": "c", "output": "1"}], "r")
    assert [item["id"] for item in items] == ["msg_r_0", "msg_x", "fc_r_2", "fco_r_3"]
    assert items[0] == {"type": "message", "role": "user", "status": "completed", "id": "msg_r_0",
                        "content": [{"type": "input_text", "text": "Hi"}]}
    assert items[1]["content"] == [{"type": "output_text", "text": "Yo"}]
    assert input_items("Hi", "r") == (items[0],)


def test_the_size_counts_the_whole_context_and_the_response():
    _, _, first = _turn({"input": "Hi"}, "Hello.", "r1")
    _, _, second = _turn({"input": "And?", "previous_response_id": "resp_r1"}, "More.", "r2", chain_of(first))
    assert second.size_bytes > first.size_bytes
    assert chain_of(second).size_bytes == sum(len(_json_bytes(i)) for i in chain_of(second).items)


def _json_bytes(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize(("status", "message"), [
    ("failed", "resp_r1' failed"), ("cancelled", "resp_r1' was cancelled"),
    ("queued", "resp_r1' is still running"), ("in_progress", "resp_r1' is still running"),
])
def test_only_a_finished_response_is_continued(status, message):
    _, response, kept = _turn({"input": "Hi"}, "He", "r1")
    unfinished = stored_response({**response, "status": status}, Chain(), kept.context)
    with pytest.raises(BadParameter, match=message) as caught:
        chain_of(unfinished)
    assert caught.value.param == "previous_response_id"
    cut = stored_response({**response, "status": "incomplete"}, Chain(), kept.context)
    assert chain_of(cut).items[-1] == response["output"][0]


def test_a_background_request_is_one_that_is_stored_streamed_or_not():
    wanted = chat_request({"model": "m", "input": "a", "background": True}, storing=True)
    assert wanted.background and wanted.store and wanted.echoed["background"] is True and not wanted.streamed
    assert chat_request({"model": "m", "input": "a", "background": True, "stream": True}, storing=True).streamed
    assert not chat_request({"model": "m", "input": "a", "background": False}, storing=True).background
    failed = too_large({"id": "resp_r", "status": "completed", "output": [{"type": "message"}],
                                         "error": None, "incomplete_details": None, "background": True})
    assert (failed["status"], failed["output"], failed["error"]["code"]) == ("failed", [], "server_error")


def _entry(num_items: int):
    items = input_items([{"role": "user", "content": str(i)} for i in range(num_items)], "r")
    return stored_response({"id": "resp_r"}, Chain(), items)


def test_input_items_are_listed_newest_first_in_pages_of_limit():
    entry = _entry(5)
    page = input_items_page(entry, {"limit": "2"})
    assert [i["id"] for i in page["data"]] == ["msg_r_4", "msg_r_3"]
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == ("list", "msg_r_4", "msg_r_3", True)
    rest = input_items_page(entry, {"limit": "2", "after": "msg_r_1"})
    assert ([i["id"] for i in rest["data"]], rest["has_more"]) == (["msg_r_0"], False)
    ascending = input_items_page(entry, {"order": "asc", "after": "msg_r_1", "before": "msg_r_4"})
    assert [i["id"] for i in ascending["data"]] == ["msg_r_2", "msg_r_3"]
    assert len(input_items_page(_entry(30), {})["data"]) == 20


def test_an_empty_page_has_no_first_or_last_id():
    page = input_items_page(_entry(1), {"after": "msg_r_0"})
    assert (page["data"], page["first_id"], page["last_id"], page["has_more"]) == ([], None, None, False)


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "ten"}, "limit"), ({"limit": "-1"}, "limit"),
    ({"order": "newest"}, "order"), ({"after": "msg_nope"}, "after"), ({"before": "msg_nope"}, "before"),
])
def test_bad_list_parameters_are_400s_naming_them(query, param):
    with pytest.raises(BadParameter) as caught:
        input_items_page(_entry(2), query)
    assert caught.value.param == param


@pytest.mark.parametrize("value", ["", "resp_", "msg_1", "resp_a/b", "resp_" + "a" * 129, 5, None])
def test_a_response_id_of_another_shape_is_a_400(value):
    with pytest.raises(BadParameter, match="must be a response id") as caught:
        response_id_of(value, "previous_response_id")
    assert caught.value.param == "previous_response_id"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "storing is off: its operator turns it on with "
                                                                  "--responses-store-bytes"),
    ({"previous_response_id": 7}, "previous_response_id", "must be a response id"),
    ({"store": "yes"}, "store", "store must be true or false"),
    ({"background": True}, "background", "background responses are not supported: this gateway stores no"),
    ({"conversation": "conv_1"}, "conversation", "conversation is not supported: this gateway stores no"),
    ({"conversation": "resp_1"}, "conversation", "must be a conversation id"),
    ({"conversation": {"id": 5}}, "conversation.id", "must be a conversation id"),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation", "mutually exclusive"),
])
def test_what_cannot_be_stored_or_continued_is_a_400_saying_why(body, param, message):
    with pytest.raises(BadParameter, match=message) as caught:
        chat_request({"model": "m", "input": "a", **body})
    assert caught.value.param == param


def test_without_storing_a_response_says_it_is_not_stored_whatever_was_asked():
    for store in (True, False, None):
        wanted = chat_request({"model": "m", "input": "a", "store": store})
        assert not wanted.store and wanted.echoed["store"] is False
    assert not chat_request({"model": "m", "input": "a", "store": False}, storing=True).store


def test_a_missing_response_is_openais_404_naming_the_id_and_the_deleted_object_says_so():
    reply = openai_codec.error_reply(ResponseNotFound("resp_gone", "previous_response_id"))
    assert reply.status == 404
    assert reply.body["error"]["type"] == "invalid_request_error" and reply.body["error"]["code"] is None
    assert reply.body["error"]["param"] == "previous_response_id" and "'resp_gone' not found" in \
        reply.body["error"]["message"]
    assert deleted("resp_a") == {"id": "resp_a", "object": "response.deleted", "deleted": True}


STORED = {"msg_1": {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": "hi", "annotations": [], "logprobs": []}]},
          "fc_1": {"id": "fc_1", "type": "function_call", "call_id": "call_1", "name": "clock", "arguments": "{}"}}


def test_an_item_reference_is_replaced_by_the_stored_item_it_names_typed_or_not():
    sent = [{"type": "item_reference", "id": "msg_1"}, {"id": "fc_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    resolved = resolved_input(sent, STORED.get)
    assert resolved == [STORED["msg_1"], STORED["fc_1"], sent[2]]
    assert chat_request({"model": "m", "input": resolved}, storing=True).chat["messages"] == [
        {"role": "assistant", "content": "hi",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    plain = [{"role": "user", "content": "a"}]
    assert resolved_input(plain, STORED.get) is plain and resolved_input("a", STORED.get) == "a"
    assert not is_item_reference({"id": "msg_1", "role": "user", "content": "a"})  # a message with its id


def test_an_unknown_item_is_a_404_and_a_bad_reference_a_400_naming_it():
    with pytest.raises(ItemNotFound, match="item with id 'msg_9' not found") as caught:
        resolved_input([{"role": "user", "content": "a"}, {"type": "item_reference", "id": "msg_9"}], STORED.get)
    assert caught.value.param == "input[1].id"
    with pytest.raises(BadParameter, match="must be the id of a stored item") as bad:
        resolved_input([{"type": "item_reference", "id": 7}], STORED.get)
    assert bad.value.param == "input[0].id"
    with pytest.raises(BadParameter, match="storing is off") as stateless:
        chat_request({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]})
    assert stateless.value.param == "input[0].type"


@pytest.mark.parametrize(("query", "expected"), [
    ({}, None), ({"stream": "false"}, None), ({"stream": "true"}, -1), ({"stream": "True", "starting_after": "7"}, 7),
])
def test_a_get_streams_from_after_starting_after(query, expected):
    assert stream_query(query) == expected


@pytest.mark.parametrize(("query", "param"), [
    ({"stream": "yes"}, "stream"), ({"stream": "true", "starting_after": "-2"}, "starting_after"),
    ({"stream": "true", "starting_after": "x"}, "starting_after"), ({"starting_after": "3"}, "starting_after"),
])
def test_bad_stream_parameters_are_400s_naming_them(query, param):
    with pytest.raises(BadParameter) as caught:
        stream_query(query)
    assert caught.value.param == param


def test_a_response_without_kept_events_cannot_be_streamed():
    with pytest.raises(BadParameter, match="no events to stream") as caught:
        replayed_events(stored_response({"id": "resp_r"}, Chain(), ()))
    assert caught.value.param == "stream"
