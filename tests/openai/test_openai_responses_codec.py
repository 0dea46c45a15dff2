"""The Responses API's translation to and from the chat path (services/gateway/fronts/openai_responses.py):
requests become chat bodies, chat answers Responses, chat stream events Responses' ordered events."""

from __future__ import annotations

import random

import pytest

from services.common import errors
from services.gateway.fronts import openai_codec
from services.gateway.fronts.openai_params import BadParameter
from services.gateway.fronts.openai_responses import ResponseEvents, chat_request, completed, renamed

TOOL = {"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}


def test_instructions_and_input_items_become_the_chat_conversation():
    wanted = chat_request({"model": "m", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "The "}, {"type": "input_text", "text": "time?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "call_1", "name": "clock", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
        {"role": "developer", "content": "Say it."},
    ]})
    assert wanted.chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The time?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "developer", "content": "Say it."},
    ]
    parsed = openai_codec.parse_chat(wanted.chat)  # the chat parser takes it
    assert [m.role for m in parsed.generate.messages] == ["system", "user", "assistant", "tool", "developer"]


def test_settings_map_to_chat_and_are_repeated_in_the_response():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    wanted = chat_request({"model": "m", "input": "hi", "max_output_tokens": 9, "temperature": 0.5,
                           "tools": [TOOL], "tool_choice": {"type": "function", "name": "clock"}, "stream": True,
                           "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
                           "include": ["message.output_text.logprobs"], "top_logprobs": 2, "metadata": {"k": "v"},
                           "seed": 4})
    assert wanted.chat == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "seed": 4,
        "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "clock", "parameters": TOOL["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "clock"}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        "logprobs": True, "top_logprobs": 2,
    }
    echoed = wanted.echoed
    assert (echoed["max_output_tokens"], echoed["tools"], echoed["metadata"], echoed["top_logprobs"]) == \
        (9, [TOOL], {"k": "v"}, 2)
    assert echoed["text"]["format"]["type"] == "json_schema"
    plain = chat_request({"model": "m", "input": "hi"})
    assert (plain.chat, plain.echoed["tool_choice"], plain.echoed["text"]) == \
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "auto", {"format": {"type": "text"}})


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),  # storing off
    ({"input": "a", "conversation": "conv_1"}, "conversation"),
    ({"input": None}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"input": "a", "instructions": 3}, "instructions"),
    ({"input": "a", "tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"input": "a", "text": "json"}, "text"),
    ({"input": "a", "include": "all"}, "include"),
])
def test_what_the_responses_front_refuses_itself_names_the_field(body, param):
    with pytest.raises(BadParameter) as caught:
        chat_request({"model": "m", **body})
    assert caught.value.param == param


@pytest.mark.parametrize(("chat_param", "param"), [
    ("max_completion_tokens", "max_output_tokens"), ("messages[3].content", "input"),
    ("response_format", "text.format"), ("tools[0].function.name", "tools[0].function.name"), (None, None),
])
def test_the_chat_parsers_refusals_are_renamed(chat_param, param):
    assert renamed(BadParameter(chat_param, "no")).param == param
    with pytest.raises(BadParameter) as caught:
        openai_codec.parse_chat(chat_request({"model": "m", "input": "a", "max_output_tokens": 0}).chat)
    assert renamed(caught.value).param == "max_output_tokens"
    too_long = renamed(openai_codec.ContextLengthExceeded("max_completion_tokens", "prompt of 9 tokens plus"))
    assert isinstance(too_long, openai_codec.ContextLengthExceeded) and too_long.param == "max_output_tokens"
    assert openai_codec.error_reply(too_long).body["error"]["code"] == "context_length_exceeded"


def _chat_reply(message: dict, finish_reason: str = "stop") -> dict:
    return {"id": "chatcmpl-r", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 4}}}


def test_a_chat_answer_becomes_a_response_with_its_items_and_usage():
    wanted = chat_request({"model": "m", "input": "a"})
    text = completed(wanted, _chat_reply({"role": "assistant", "content": "Hello"}), "r")
    assert (text["id"], text["status"], text["created_at"], text["incomplete_details"]) == ("resp_r", "completed", 7, None)
    assert text["output"] == [{"type": "message", "id": "msg_r", "status": "completed", "role": "assistant",
                               "content": [{"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}]}]
    assert text["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 3,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}
    called = completed(wanted, _chat_reply({"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls"), "r")
    assert called["output"] == [{"type": "function_call", "id": "fc_call_1", "call_id": "call_1", "name": "clock",
                                 "arguments": "{}", "status": "completed"}]
    cut = completed(wanted, _chat_reply({"role": "assistant", "content": "Hel"}, "length"), "r")
    assert (cut["status"], cut["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})


def _chunk(delta: dict, finish_reason: str | None = None, usage: dict | None = None) -> dict:
    event: dict = {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if usage is not None:
        event = {"choices": [], "usage": usage}
    return event


def test_a_streamed_text_then_a_call_open_and_close_their_items_in_order():
    events = ResponseEvents(chat_request({"model": "m", "input": "a"}), "r", 7, "m")
    out = events.opened()
    out += events.chunk(_chunk({"role": "assistant", "content": ""}))
    out += events.chunk(_chunk({"content": "Let"}))
    out += events.chunk(_chunk({"content": " me"}))
    out += events.chunk(_chunk({"tool_calls": [{"index": 0, **CALL, "function": {"name": "clock", "arguments": "{"}}]}))
    out += events.chunk(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}, "tool_calls"))
    out += events.chunk(_chunk({}, usage={"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}))
    out += events.closed()
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["output_index"] for e in out if "output_index" in e] == [0] * 7 + [1] * 5
    final = out[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Let me" and final["output"][1]["arguments"] == "{}"
    assert final["usage"]["output_tokens"] == 3 and out[0]["response"]["status"] == "in_progress"


def test_a_stream_with_nothing_said_still_answers_one_message_and_a_late_error_fails_it():
    events = ResponseEvents(chat_request({"model": "m", "input": "a"}), "r", 7, "m")
    out = events.opened() + events.chunk(_chunk({"role": "assistant", "content": ""}, "length")) + events.closed()
    assert [e["type"] for e in out][-2:] == ["response.output_item.done", "response.incomplete"]
    assert out[-1]["response"]["output"][0]["content"][0]["text"] == ""
    failed = ResponseEvents(chat_request({"model": "m", "input": "a"}), "r", 7, "m")
    failed.opened()
    (event,) = failed.failed({"message": "the worker failed", "type": "internal_error"})
    assert (event["type"], event["response"]["status"], event["response"]["error"]) == \
        ("response.failed", "failed", {"code": "server_error", "message": "the worker failed"})


def test_random_bodies_are_parsed_or_refused_never_crash():
    rng = random.Random(7)
    leaves = [None, True, 0, -1, 3, 2.5, "", "x", "function", "message", "user", "function_call",
              "function_call_output", "json_schema", "input_text", [], {}]
    keys = ["model", "input", "instructions", "tools", "tool_choice", "text", "format", "type", "role", "content",
            "name", "call_id", "arguments", "output", "max_output_tokens", "include", "metadata", "top_logprobs",
            "stream", "parameters", "schema", "text_", "background", "previous_response_id", "store"]

    def value(depth: int):
        roll = rng.random()
        if depth > 3 or roll < 0.4:
            return rng.choice(leaves)
        if roll < 0.7:
            return [value(depth + 1) for _ in range(rng.randrange(3))]
        return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(4))}

    for _ in range(3000):
        body = {"model": "m", **{rng.choice(keys): value(0) for _ in range(rng.randrange(5))}}
        try:
            openai_codec.parse_chat(chat_request(body).chat)
        except errors.InfermeshError:
            pass
