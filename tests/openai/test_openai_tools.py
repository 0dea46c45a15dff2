"""Tool calls on the OpenAI front as plain functions: tools and tool_choice checked into the
GenerateRequest (400s naming the field), the constrained schemas of required and named choices,
each format's parser on fixed texts, and a choice's output split into content and tool_calls,
whole and streamed (OpenAI's delta shapes)."""

from __future__ import annotations

import itertools
import json

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.tool_call_formats import GRANITE, HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, QWEN3_CODER
from services.gateway.fronts import openai_codec
from services.gateway.fronts.tool_call_parsers import PARSERS, Parsed, ParsedCall
from services.gateway.fronts.tool_calls import (
    AUTO,
    NAMED,
    NONE,
    REQUIRED,
    ChatTools,
    GrpcToolCalls,
    ToolCallSplitter,
    grpc_tool_choice,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock"}}]


def chat(**over) -> openai_codec.OpenAIRequest:
    return openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **over})


def refusal(**over) -> tuple[str | None, str]:
    with pytest.raises(openai_codec.BadParameter) as caught:
        chat(**over)
    return caught.value.param, caught.value.message


# -- requests ---------------------------------------------------------------------------


def test_tools_go_upstream_and_auto_is_the_default_choice():
    parsed = chat(tools=TOOLS)
    assert [(t.name, t.description, t.parameters) for t in parsed.generate.tools] == [
        ("weather", "Weather now", json.dumps(WEATHER)), ("clock", "", "")]
    assert parsed.tools == ChatTools(AUTO)
    assert not parsed.generate.sampling.HasField("structured") and parsed.structured_param is None
    assert chat(tools=TOOLS, tool_choice="none").tools == ChatTools(NONE)
    assert chat().tools is None and chat(tools=[], tool_choice="none").tools is None


def test_a_named_choice_constrains_the_output_to_that_functions_arguments():
    parsed = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "weather"}})
    assert parsed.tools == ChatTools(NAMED, "weather")
    assert json.loads(parsed.generate.sampling.structured.json_schema) == WEATHER
    assert parsed.structured_param == "tools"  # the scheduler's refusal of the schema names it


@pytest.mark.parametrize(("parallel", "bounds"), [(None, {"minItems": 1}), (False, {"minItems": 1, "maxItems": 1})])
def test_required_constrains_the_output_to_an_array_of_calls_of_the_tools(parallel, bounds):
    over = {} if parallel is None else {"parallel_tool_calls": parallel}
    parsed = chat(tools=TOOLS, tool_choice="required", **over)
    schema = json.loads(parsed.generate.sampling.structured.json_schema)
    assert {k: v for k, v in schema.items() if k.endswith("Items")} == bounds
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    params = [item["properties"]["parameters"] for item in schema["items"]["anyOf"]]
    assert names == [["weather"], ["clock"]] and params == [WEATHER, {"type": "object", "properties": {}}]


@pytest.mark.parametrize(("over", "param", "fragment"), [
    ({"tools": {"type": "function"}}, "tools", "tools must be a list"),
    ({"tools": ["x"]}, "tools[0]", "tools[0] must be"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "must match"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name", "'clock' is offered twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "must be a JSON schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", "must be a JSON schema of an object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice names 'nope', which is not among the tools (weather, clock)"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", 'tool_choice must be "auto", "none", "required"'),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls", "must be a boolean"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined with response_format"),
])
def test_bad_tools_are_400s_naming_the_field(over, param, fragment):
    got_param, message = refusal(**over)
    assert got_param == param and fragment in message, message


def test_completions_refuse_tools():
    with pytest.raises(openai_codec.BadParameter) as caught:
        openai_codec.parse_completion({"model": "m", "prompt": "a", "tools": TOOLS})
    assert caught.value.param == "tools"


def test_a_conversation_with_calls_and_results_goes_upstream_whole():
    parsed = openai_codec.parse_chat({"model": "m", "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    assistant, tool = parsed.generate.messages[1:]
    assert (assistant.content, [(c.id, c.name, c.arguments) for c in assistant.tool_calls]) == (
        "", [("call_1", "weather", '{"city": "Oslo"}')])
    assert (tool.role, tool.content, tool.tool_call_id) == ("tool", "sunny", "call_1")


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_turns_are_400s_naming_the_field(message, param):
    with pytest.raises(openai_codec.BadParameter) as caught:
        openai_codec.parse_chat({"model": "m", "messages": [message]})
    assert caught.value.param == param


# -- parsers ----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("It is sunny.", Parsed("It is sunny.", ())),
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     Parsed("", (ParsedCall("weather", '{"city": "Oslo"}'),))),
    ('Let me look.\n<tool_call>{"name": "weather", "arguments": {"city": "Köln"}}</tool_call>\n'
     '<tool_call>{"name": "clock", "arguments": {}}</tool_call>',
     Parsed("Let me look.\n", (ParsedCall("weather", '{"city": "Köln"}'), ParsedCall("clock", "{}")))),
    ('<tool_call>{"name": "clock", "arguments": {}}', Parsed("", (ParsedCall("clock", "{}"),))),  # cut at EOS
    ('<tool_call>{"name": "clock", "arguments": {</tool_call>',
     Parsed('<tool_call>{"name": "clock", "arguments": {</tool_call>', ())),  # malformed: content
    ('<tool_call>{"arguments": {}}</tool_call>', Parsed('<tool_call>{"arguments": {}}</tool_call>', ())),
])
def test_hermes_calls_are_read_from_tool_call_elements(text, expected):
    assert PARSERS[HERMES].parse(text) == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("It is sunny.", Parsed("It is sunny.", ())),
    ('{"name": "weather", "parameters": {"city": "Oslo"}}', Parsed("", (ParsedCall("weather", '{"city": "Oslo"}'),))),
    ('<|python_tag|>{"name": "clock", "parameters": {}}; {"name": "weather", "arguments": {"city": "Rome"}}',
     Parsed("", (ParsedCall("clock", "{}"), ParsedCall("weather", '{"city": "Rome"}')))),
    ('  {"name": "weather", "parameters": {"city": "Oslo"', Parsed('  {"name": "weather", "parameters": {"city": "Oslo"', ())),
    ('{"city": "Oslo"}', Parsed('{"city": "Oslo"}', ())),
])
def test_llama3_json_calls_are_the_whole_reply(text, expected):
    assert PARSERS[LLAMA3_JSON].parse(text) == expected


OSLO_CALL = ParsedCall("weather", '{"city": "Oslo"}')


@pytest.mark.parametrize("parser", [GRANITE, MISTRAL])
@pytest.mark.parametrize(("text", "expected"), [
    ("It is sunny.", Parsed("It is sunny.", ())),
    # the marker dropped by the detokenizer (a special token), or kept, or another spelling of it
    ('[{"name": "weather", "arguments": {"city": "Oslo"}}]', Parsed("", (OSLO_CALL,))),
    ('{MARK} [{"name": "weather", "arguments": {"city": "Oslo"}, "id": "a1b2c3d4e"}, {"name": "clock", '
     '"arguments": {}}]', Parsed("", (OSLO_CALL, ParsedCall("clock", "{}")))),
    ('Checking.{MARK}[{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
     Parsed("Checking.", (OSLO_CALL,))),
    ('{MARK}{"name": "weather", "arguments": {"city": "Oslo"}}', Parsed("", (OSLO_CALL,))),  # one object
    ('[{"name": "weather", "arguments": {"city": "Os', Parsed('[{"name": "weather", "arguments": {"city": "Os', ())),
    ("[1, 2]", Parsed("[1, 2]", ())),  # an array, not of calls: content
    ("[]", Parsed("[]", ())),
])
def test_granite_and_mistral_calls_are_a_json_array_after_their_marker_or_not(parser, text, expected):
    mark = {GRANITE: "<|tool_call|>", MISTRAL: "[TOOL_CALLS]"}[parser]
    text = text.replace("{MARK}", mark)
    expected = Parsed(expected.content.replace("{MARK}", mark), expected.calls)
    assert PARSERS[parser].parse(text) == expected


@pytest.mark.parametrize(("parser", "text", "end"), [
    (GRANITE, "  ", 0), (GRANITE, ' [{"na', 0), (GRANITE, "Sure <|tool", 5), (GRANITE, "Sure <|tool_call|>[", 5),
    (GRANITE, "Hi [x]", 6), (GRANITE, ' {"name', 0), (MISTRAL, "[TOOL_C", 0), (MISTRAL, "Yes [TOOL", 4),
    (MISTRAL, "Yes", 0), (MISTRAL, "Yes.", 4),  # a first word may be a v11 call's name ([TOOL_CALLS] dropped)
    (HERMES, "Sure", 4), (HERMES, "Sure <tool", 5), (HERMES, "Sure <tool_call>{", 5), (HERMES, "a<b", 3), (HERMES, "a<t", 1),
    (LLAMA3_JSON, "  ", 0), (LLAMA3_JSON, ' {"na', 0), (LLAMA3_JSON, "<|python", 0), (LLAMA3_JSON, "Hi", 2),
])
def test_only_what_cannot_begin_a_call_is_streamed_before_the_end(parser, text, end):
    assert PARSERS[parser].content_end(text) == end


# -- responses --------------------------------------------------------------------------


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(splitter: ToolCallSplitter, pieces: list[str], parser: str = "") -> tuple[str, list[dict]]:
    content, deltas = "", []
    for i, piece in enumerate(pieces):
        text, calls = splitter.feed(piece, i == len(pieces) - 1, parser)
        content += text
        deltas += calls
    return content, deltas


def accumulated(deltas: list[dict]) -> list[dict]:
    """What a client builds from the deltas, as the openai package's stream helpers do."""
    calls: list[dict] = []
    for delta in deltas:
        if delta["index"] == len(calls):
            calls.append({"id": delta["id"], "type": delta["type"], "function": {"name": delta["function"]["name"],
                                                                                 "arguments": ""}})
        calls[delta["index"]]["function"]["arguments"] += delta["function"]["arguments"]
    return calls


def test_named_calls_stream_their_arguments_as_they_come():
    splitter = ToolCallSplitter(ChatTools(NAMED, "weather"), ids())
    content, deltas = stream(splitter, ['{"ci', 'ty": "Os', 'lo"}'])
    assert content == "" and deltas[0] == {"index": 0, "id": "call_0", "type": "function",
                                           "function": {"name": "weather", "arguments": '{"ci'}}
    assert deltas[1:] == [{"index": 0, "function": {"arguments": 'ty": "Os'}},
                          {"index": 0, "function": {"arguments": 'lo"}'}}]
    assert accumulated(deltas) == splitter.calls == [
        {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    assert splitter.message() == {"role": "assistant", "content": None, "tool_calls": splitter.calls}
    assert (splitter.finish_reason("stop"), splitter.finish_reason("length")) == ("tool_calls", "length")


def test_required_calls_come_whole_at_the_end():
    splitter = ToolCallSplitter(ChatTools(REQUIRED), ids())
    content, deltas = stream(splitter, ['[{"name": "clock", "param', 'eters": {}}, {"name": "weather", '
                                        '"parameters": {"city": "Oslo"}}]'])
    assert content == ""
    assert accumulated(deltas) == splitter.calls == [
        {"id": "call_0", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    cut = ToolCallSplitter(ChatTools(REQUIRED), ids())
    assert stream(cut, ['[{"name": "clo']) == ('[{"name": "clo', [])  # cut by max_tokens: content
    assert cut.finish_reason("length") == "length"


def test_auto_streams_content_until_a_call_may_begin_then_parses_the_rest():
    splitter = ToolCallSplitter(ChatTools(AUTO), ids())
    pieces = ["Let me ", "check. <tool", '_call>{"name": "weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    sent = [splitter.feed(p, i == 3, HERMES) for i, p in enumerate(pieces)]
    assert [content for content, _ in sent] == ["Let me ", "check. ", "", ""]
    assert accumulated(sent[-1][1]) == splitter.calls == [
        {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]
    assert splitter.message()["content"] == "Let me check. "
    assert splitter.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize(("parser", "pieces"), [
    (HERMES, ["The answer ", "<b>is</b> 4", "2"]),
    (LLAMA3_JSON, ["  {not json", "}"]),
    (GRANITE, ["[See the ", "docs](https://example.com)"]),
    (MISTRAL, ["Yes, [1", ", 2]"]),
    ("", ['<tool_call>{"name": "clock", "arguments": {}}</tool_call>']),  # no known format: all content
])
def test_auto_text_without_a_call_is_ordinary_content(parser, pieces):
    splitter = ToolCallSplitter(ChatTools(AUTO), ids())
    assert stream(splitter, pieces, parser) == ("".join(pieces), [])
    assert splitter.message() == {"role": "assistant", "content": "".join(pieces)}
    assert splitter.finish_reason("stop") == "stop"


@pytest.mark.parametrize("parser", [HERMES, LLAMA3_JSON, GRANITE, MISTRAL, QWEN3_CODER, PYTHONIC])
def test_auto_without_parallel_calls_keeps_only_the_first_call_as_vllm_does(parser):
    array = '[{"name": "clock", "arguments": {}}, {"name": "weather", "arguments": {"city": "Oslo"}}]'
    text = {HERMES: 'Both. <tool_call>{"name": "clock", "arguments": {}}</tool_call>\n'
                    '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>',
            LLAMA3_JSON: '{"name": "clock", "parameters": {}}; {"name": "weather", "parameters": {"city": "Oslo"}}',
            GRANITE: "<|tool_call|>" + array, MISTRAL: "Both. [TOOL_CALLS]" + array,
            QWEN3_CODER: "Both. <tool_call>\n<function=clock>\n</function>\n</tool_call>\n<tool_call>\n"
                         "<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
            PYTHONIC: '[clock(), weather(city="Oslo")]'}
    parsed = chat(tools=TOOLS, parallel_tool_calls=False).tools
    assert parsed == ChatTools(AUTO, parallel=False)
    splitter = ToolCallSplitter(parsed, ids())
    content, deltas = stream(splitter, [text[parser][:9], text[parser][9:]], parser)
    assert accumulated(deltas) == splitter.calls == [
        {"id": "call_0", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]
    assert content == ("Both. " if parser in (HERMES, MISTRAL, QWEN3_CODER) else "") and splitter.finish_reason("stop") == "tool_calls"
    both = ToolCallSplitter(chat(tools=TOOLS, parallel_tool_calls=True).tools, ids())
    assert len(stream(both, [text[parser]], parser)[1]) == 2


def test_none_renders_tools_but_parses_no_calls():
    splitter = ToolCallSplitter(ChatTools(NONE), ids())
    text = '<tool_call>{"name": "clock", "arguments": {}}</tool_call>'
    assert stream(splitter, [text], HERMES) == (text, []) and splitter.finish_reason("stop") == "stop"


# -- the gRPC Generate's tool_choice ----------------------------------------------------


def grpc_request(tool_choice: str, **over) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="user", content="hi")], tool_choice=tool_choice,
        tools=[gateway_pb2.Tool(name="weather", parameters=json.dumps(WEATHER)), gateway_pb2.Tool(name="clock")],
        **over)


@pytest.mark.parametrize(("tool_choice", "expected", "schema"), [
    ("", ChatTools(AUTO), None), ("none", ChatTools(NONE), None), ("weather", ChatTools(NAMED, "weather"), WEATHER),
])
def test_grpc_tool_choice_is_checked_and_applied_as_openais(tool_choice, expected, schema):
    request = grpc_request(tool_choice)
    assert grpc_tool_choice(request) == expected
    structured = request.sampling.structured.json_schema
    assert (json.loads(structured) if structured else None) == schema
    required = grpc_request("required")
    assert grpc_tool_choice(required) == ChatTools(REQUIRED)
    assert "maxItems" not in json.loads(required.sampling.structured.json_schema)  # parallel calls allowed


@pytest.mark.parametrize("tool_choice", ["", "required"])
def test_grpc_parallel_tool_calls_false_allows_one_call_as_openais(tool_choice):
    request = grpc_request(tool_choice, parallel_tool_calls=False)
    chosen = grpc_tool_choice(request)
    assert chosen is not None and not chosen.parallel
    if tool_choice == "required":
        assert json.loads(request.sampling.structured.json_schema)["maxItems"] == 1
    assert grpc_tool_choice(grpc_request(tool_choice, parallel_tool_calls=True)).parallel


@pytest.mark.parametrize(("request_", "message"), [
    (grpc_request("nope"), "tool_choice names 'nope', which is not among the tools (weather, clock)"),
    (gateway_pb2.GenerateRequest(prompt="a", tool_choice="required"), "tool_choice needs tools"),
    (grpc_request("required", sampling=common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(
        json_object=True))), "tool_choice 'required' constrains the output itself; it cannot be combined with "
                             "response_format or guided_*"),
    (gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="a")],
                                 tools=[gateway_pb2.Tool(name="f", parameters="[")]),
     "tools[0].parameters must be a JSON schema (an object, as JSON text)"),
])
def test_a_bad_grpc_tool_choice_is_invalid_argument(request_, message):
    with pytest.raises(errors.InvalidArgument) as caught:
        grpc_tool_choice(request_)
    assert caught.value.message == message


def test_grpc_calls_are_set_on_the_last_chunk_only():
    calls = GrpcToolCalls(ChatTools(NAMED, "weather"))
    first = gateway_pb2.GenerateResponse(text='{"city": ', tool_call_parser=HERMES)
    last = gateway_pb2.GenerateResponse(text='"Oslo"}', finish_reason=common_pb2.FINISH_REASON_EOS)
    calls.add(first)
    calls.add(last)
    assert not first.tool_calls
    assert [(c.name, c.arguments) for c in last.tool_calls] == [("weather", '{"city": "Oslo"}')]
