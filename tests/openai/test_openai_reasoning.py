"""Reasoning on the OpenAI front (services/gateway/fronts/reasoning.py through openai_codec and
openai_responses): chat's message.reasoning_content and reasoning, streamed deltas that carry it until
</think> and content after, tool calls read from the answer only, completions left as written, and
Responses' reasoning item before the message, whole and streamed."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.reasoning_formats import DEEPSEEK_R1, QWEN3
from services.gateway.fronts import openai_codec
from services.gateway.fronts.openai_choices import ChoiceResult
from services.gateway.fronts.openai_responses import ResponseEvents, chat_request, completed
from services.gateway.fronts.reasoning import ReasoningFormat, ReasoningSplitter
from services.gateway.fronts.tool_calls import ToolCallSplitter

TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]
PIECES = ["<thi", "nk>Sky is ", "blue.</th", "ink>\n\nRay", "leigh."]
END = common_pb2.FINISH_REASON_EOS


def chunks(pieces: list[str], parser: str = QWEN3, **first) -> list[gateway_pb2.GenerateResponse]:
    out = [gateway_pb2.GenerateResponse(text=piece) for piece in pieces]
    out[0].reasoning_parser = parser
    out[0].MergeFrom(gateway_pb2.GenerateResponse(**first))
    out[-1].finish_reason = END
    return out


def whole(body: dict, pieces: list[str], parser: str = QWEN3, **first) -> dict:
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], **body})
    result = ChoiceResult()
    for chunk in chunks(pieces, parser, **first):
        result.add(chunk)
    return openai_codec.full_response(parsed, 1, [result])["choices"][0]


def streamed(body: dict, pieces: list[str], parser: str = QWEN3) -> list[dict]:
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": True,
                                      **body})
    upstream = chunks(pieces, parser)
    splitter = ReasoningSplitter(ReasoningFormat.of_chunk(upstream[0]), openai_codec.constrained(parsed))
    tools = ToolCallSplitter(parsed.tools)
    return [openai_codec.stream_chunk(parsed, 1, chunk, i == 0, tools=tools, parser=chunk.tool_call_parser or "hermes",
                                      reasoning=splitter)["choices"][0]
            for i, chunk in enumerate(upstream)]


def test_a_chat_message_holds_the_reasoning_apart_under_both_of_vllms_names():
    message = whole({}, PIECES)["message"]
    assert message == {"role": "assistant", "content": "\n\nRayleigh.", "reasoning_content": "Sky is blue.",
                       "reasoning": "Sky is blue."}


def test_a_model_without_reasoning_answers_with_null_reasoning_fields():
    message = whole({}, PIECES, parser="")["message"]
    assert message == {"role": "assistant", "content": "".join(PIECES), "reasoning_content": None, "reasoning": None}


def test_a_reply_cut_mid_thought_is_all_reasoning_with_null_content():
    message = whole({}, ["still thin", "king"], parser=DEEPSEEK_R1)["message"]
    assert (message["reasoning_content"], message["content"]) == ("still thinking", None)


def test_an_opened_prompt_makes_the_output_reasoning_until_the_end_tag():
    message = whole({}, ["why</think>", "because"], reasoning_opened=True)["message"]
    assert (message["reasoning_content"], message["content"]) == ("why", "because")


def test_deltas_carry_reasoning_until_the_end_tag_then_content_and_never_part_of_a_tag():
    deltas = [choice["delta"] for choice in streamed({}, PIECES)]
    assert deltas == [
        {"role": "assistant", "content": ""},  # "<thi" is held: it may open a block
        {"reasoning_content": "Sky is ", "reasoning": "Sky is "},
        {"reasoning_content": "blue.", "reasoning": "blue."},  # "</th" is held
        {"content": "\n\nRay"},
        {"content": "leigh."},
    ]


def test_include_reasoning_false_leaves_the_reasoning_out_and_the_answer_as_it_was():
    """vLLM's include_reasoning: the answer is still only what follows </think>."""
    message = whole({"include_reasoning": False}, PIECES)["message"]
    assert message == {"role": "assistant", "content": "\n\nRayleigh.", "reasoning_content": None, "reasoning": None}
    deltas = [choice["delta"] for choice in streamed({"include_reasoning": False}, PIECES)]
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nRayleigh."
    with pytest.raises(openai_codec.BadParameter, match="include_reasoning"):
        whole({"include_reasoning": "no"}, PIECES)


def test_tool_calls_are_parsed_from_the_answer_after_the_reasoning():
    pieces = ["<think>I need <tool_call> the clock.</think>", '<tool_call>{"name": "clock", ', '"arguments": {}}</tool_call>']
    choice = whole({"tools": TOOLS}, pieces, tool_call_parser="hermes")
    assert choice["message"]["reasoning_content"] == "I need <tool_call> the clock."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["clock"]
    assert choice["finish_reason"] == "tool_calls"
    deltas = [c["delta"] for c in streamed({"tools": TOOLS}, pieces)]
    assert [d.get("reasoning_content") for d in deltas] == ["I need <tool_call> the clock.", None, None]
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", [])] == ["clock"]


def test_a_constrained_output_is_all_content_even_for_deepseek_r1_where_the_grammar_held_it_all():
    body = {"response_format": {"type": "json_object"}}
    message = whole(body, ['{"a": ', "1}"], parser=DEEPSEEK_R1)["message"]
    assert (message["reasoning_content"], message["content"]) == (None, '{"a": 1}')


def test_a_grammar_that_waited_for_the_reasoning_leaves_it_apart_and_the_json_as_content():
    body = {"response_format": {"type": "json_object"}}
    message = whole(body, ["sky is", " blue</think>", '{"a": ', "1}"], parser=DEEPSEEK_R1,
                    grammar_after_reasoning=True)["message"]
    assert (message["reasoning_content"], message["content"]) == ("sky is blue", '{"a": 1}')
    message = whole(body, ['{"a": 1}'], grammar_after_reasoning=True)["message"]  # qwen3 that did not open one
    assert (message["reasoning_content"], message["content"]) == (None, '{"a": 1}')


def test_completions_are_left_as_the_model_wrote_them():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a"})
    result = ChoiceResult()
    for chunk in chunks(PIECES):
        result.add(chunk)
    assert openai_codec.full_response(parsed, 1, [result])["choices"][0]["text"] == "".join(PIECES)


def test_a_response_puts_a_reasoning_item_before_the_message():
    wanted = chat_request({"model": "m", "input": "a"})
    reply = {"id": "chatcmpl-r", "object": "chat.completion", "created": 7, "model": "m",
             "choices": [{"index": 0, "message": whole({}, PIECES)["message"], "logprobs": None,
                          "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
    output = completed(wanted, reply, "r")["output"]
    assert output[0] == {"type": "reasoning", "id": "rs_r", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "Sky is blue."}],
                         "encrypted_content": None, "status": "completed"}
    assert output[1]["type"] == "message" and output[1]["content"][0]["text"] == "\n\nRayleigh."


def test_a_streamed_response_opens_and_closes_the_reasoning_item_then_the_message():
    events = ResponseEvents(chat_request({"model": "m", "input": "a"}), "r", 7, "m")
    out = events.opened()
    for choice in streamed({}, PIECES):
        out += events.chunk({"choices": [choice]})
    out += events.closed()
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["delta"] for e in out if e["type"] == "response.reasoning_text.delta"] == ["Sky is ", "blue."]
    final = out[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["reasoning", "message"]
    assert final[0]["content"] == [{"type": "reasoning_text", "text": "Sky is blue."}]
    assert final[0]["status"] == "completed" and final[1]["content"][0]["text"] == "\n\nRayleigh."


def test_a_streamed_response_that_only_reasoned_still_answers_an_empty_message():
    events = ResponseEvents(chat_request({"model": "m", "input": "a"}), "r", 7, "m")
    out = events.opened()
    for choice in streamed({}, ["<think>hmm"], parser=QWEN3):
        out += events.chunk({"choices": [choice]})
    out += events.closed()
    assert [item["type"] for item in out[-1]["response"]["output"]] == ["reasoning", "message"]


def test_a_reasoning_item_sent_back_as_input_is_accepted_and_not_rendered():
    wanted = chat_request({"model": "m", "input": [
        {"role": "user", "content": "a"},
        {"type": "reasoning", "id": "rs_r", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "user", "content": "c"}]})
    assert [m["role"] for m in wanted.chat["messages"]] == ["user", "assistant", "user"]
