"""The tool-call formats of 2026's models, read as vLLM's parsers of the same names read them:
Mistral's tokenizer v11+ calls (`name[ARGS]{...}`, its markers kept or dropped), qwen3_coder's XML
with each parameter typed by the request's schemas, and pythonic lists of calls read with `ast`.
Every reply, old formats' included, is also streamed a character at a time: no prefix ever sends as
content what the whole reply reads as a call, and the stream ends where the whole reply does."""

from __future__ import annotations

import itertools
import json

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.tool_call_formats import GRANITE, HERMES, LLAMA3_JSON, MISTRAL, PYTHONIC, QWEN3_CODER
from services.gateway.fronts import openai_codec
from services.gateway.fronts.tool_call_parsers import PARSERS, Parsed, ParsedCall, parser_for, typed_parameter
from services.gateway.fronts.tool_calls import (
    AUTO,
    ChatTools,
    GrpcToolCalls,
    ToolCallSplitter,
    grpc_tool_choice,
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "threshold": {"type": "number"},
    "hourly": {"type": "boolean"}, "fields": {"type": "array", "items": {"type": "string"}},
    "where": {"type": "object"}, "note": {"type": ["string", "null"]}}, "required": ["city"]}
SCHEMAS = {"weather": WEATHER, "clock": {"type": "object", "properties": {}}}
OSLO = ParsedCall("weather", '{"city": "Oslo"}')
CLOCK = ParsedCall("clock", "{}")


def parse(parser: str, text: str) -> Parsed:
    found = parser_for(parser, SCHEMAS)
    assert found is not None
    return found.parse(text)


# -- mistral: tokenizer v11+ ------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ('[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}', Parsed("", (OSLO,))),
    ('weather{"city": "Oslo"}', Parsed("", (OSLO,))),  # both markers are special tokens: dropped
    ('[TOOL_CALLS]weather{"city": "Oslo"}', Parsed("", (OSLO,))),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock[ARGS]{}', Parsed("", (OSLO, CLOCK))),
    ('weather{"city": "Oslo"}clock{}\n', Parsed("", (OSLO, CLOCK))),
    ('Checking both.\n[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}\n[TOOL_CALLS]clock[ARGS]{}',
     Parsed("Checking both.\n", (OSLO, CLOCK))),
    ('[TOOL_CALLS]weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}', Parsed("", (OSLO,))),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Köln", "days": [1, 2]}',
     Parsed("", (ParsedCall("weather", '{"city": "Köln", "days": [1, 2]}'),))),
    # tokenizer v3's array, as before
    ('[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "clock", "arguments": {}}]',
     Parsed("", (OSLO, CLOCK))),
])
def test_mistral_reads_v11_calls_by_name_with_or_without_their_markers(text, expected):
    assert parse(MISTRAL, text) == expected


@pytest.mark.parametrize("text", [
    '[TOOL_CALLS]weather[ARGS]{"city": "Os',  # cut by max_tokens
    '[TOOL_CALLS]weather[ARGS]["Oslo"]',  # arguments that are not an object
    '[TOOL_CALLS]get weather[ARGS]{}',
    '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"} and then some',
    '[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]',
    '[TOOL_CALLS][ARGS]{}',
    # Content before a call whose [TOOL_CALLS] was dropped: not told apart from content, so content.
    'Checking.weather{"city": "Oslo"}',
    "Sure, I can help.",
    "Yes",
])
def test_mistral_text_that_is_not_wholly_calls_is_content(text):
    assert parse(MISTRAL, text) == Parsed(text, ())


@pytest.mark.parametrize(("text", "end"), [
    ("", 0), ("weath", 0), ("weather[AR", 0), ("weather[CALL_ID]a1", 0), ('weather{"ci', 0),
    ("Yes", 0),  # a first word may be a call's name whose [TOOL_CALLS] was dropped
    ("Yes,", 4), ("Sure thing", 10), ("Hi [TOOL", 3), ("Hi [TOOL_CALLS]weather", 3), ("weather[x", 9),
])
def test_mistral_holds_what_may_still_be_a_v11_call(text, end):
    assert PARSERS[MISTRAL].content_end(text) == end


# -- qwen3_coder ------------------------------------------------------------------------


def xml_call(name: str, **parameters: str) -> str:
    """A call as Qwen3-Coder writes it (its template's own line breaks)."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize(("text", "expected"), [
    (xml_call("weather", city="New York", days="3"),
     Parsed("", (ParsedCall("weather", '{"city": "New York", "days": 3}'),))),
    ("Let me check both.\n" + xml_call("weather", city="Oslo") + "\n" + xml_call("clock"),
     Parsed("Let me check both.\n", (OSLO, CLOCK))),
    (xml_call("weather", city="Oslo", threshold="2.5", hourly="True", fields='["wind", "rain"]',
              where='{"lat": 59.9}', note="null"),
     Parsed("", (ParsedCall("weather", '{"city": "Oslo", "threshold": 2.5, "hourly": true, "fields": ["wind", '
                                       '"rain"], "where": {"lat": 59.9}, "note": null}'),))),
    # text is text: a string parameter that looks like a number, lines and tags inside a value
    (xml_call("weather", city="42", note="line one\n  <b>two</b>\n"),
     Parsed("", (ParsedCall("weather", '{"city": "42", "note": "line one\\n  <b>two</b>\\n"}'),))),
    # a parameter the schema does not name, a tool not offered: strings, as vLLM
    (xml_call("weather", city="Oslo", unit="7"), Parsed("", (ParsedCall("weather", '{"city": "Oslo", "unit": "7"}'),))),
    (xml_call("search", limit="5"), Parsed("", (ParsedCall("search", '{"limit": "5"}'),))),
    # a value that does not read as its type stays text
    (xml_call("weather", city="Oslo", days="three"),
     Parsed("", (ParsedCall("weather", '{"city": "Oslo", "days": "three"}'),))),
    # </parameter> left out before the next one; the reply cut before its closing tags; no <tool_call>
    ("<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n<parameter=days>\n2\n</parameter>\n</function>",
     Parsed("", (ParsedCall("weather", '{"city": "Oslo", "days": 2}'),))),
    ("<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n", Parsed("", (OSLO,))),
    ("Sure: <function=clock>\n</function>", Parsed("Sure: ", (CLOCK,))),
])
def test_qwen3_coder_reads_xml_calls_and_types_their_parameters_by_the_schemas(text, expected):
    assert parse(QWEN3_CODER, text) == expected


@pytest.mark.parametrize("text", [
    "It is sunny.",
    "<tool_call>\n<function=weather>\nOslo\n</function>\n</tool_call>",  # a value outside any parameter
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>',  # hermes's JSON
    xml_call("weather", city="Oslo") + "\nHope that helps!",  # text after the calls
    "<tool_call>\n<function=>\n</function>\n</tool_call>",
    "<tool_call>\n</tool_call>",
])
def test_qwen3_coder_text_that_is_not_wholly_calls_after_the_first_is_content(text):
    assert parse(QWEN3_CODER, text) == Parsed(text, ())


def test_both_fronts_give_auto_the_tools_schemas_to_type_parameters_by():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
    chat = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools})
    assert chat.tools is not None and chat.tools.schemas == {"weather": WEATHER}
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")],
                                          tools=[gateway_pb2.Tool(name="weather", parameters=json.dumps(WEATHER))])
    chosen = grpc_tool_choice(request)
    assert chosen is not None
    last = gateway_pb2.GenerateResponse(text=xml_call("weather", city="Oslo", days="2"), tool_call_parser=QWEN3_CODER,
                                        finish_reason=common_pb2.FINISH_REASON_EOS)
    GrpcToolCalls(chosen).add(last)
    assert [(c.name, c.arguments) for c in last.tool_calls] == [("weather", '{"city": "Oslo", "days": 2}')]


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("7", {"type": "integer"}, 7), (" 7", {"type": "integer"}, 7), ("7.5", {"type": "integer"}, "7.5"),
    ("7.5", {"type": "number"}, 7.5), ("7.0", {"type": "number"}, 7), ("1e3", {"type": "number"}, 1000),
    ("nan", {"type": "number"}, "nan"), ("inf", {"type": "number"}, "inf"),
    ("true", {"type": "boolean"}, True), ("FALSE", {"type": "boolean"}, False), ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("{'a': (1, 2)}", {"type": "object"}, {"a": [1, 2]}),
    ("[1, 'x']", {"type": "array"}, [1, "x"]), ("{1, 2}", {"type": "array"}, "{1, 2}"),
    ("__import__('os')", {"type": "object"}, "__import__('os')"),  # read as a literal or kept as text, never run
    ("null", {"type": "string"}, None), ("NULL", None, None),
    ("3", {"type": ["integer", "null"]}, 3), ("3", {"enum": [3, 4]}, "3"), ("3", None, "3"), ("3", {}, "3"),
])
def test_a_qwen3_coder_parameter_is_typed_by_its_schemas_type(text, schema, value):
    typed = typed_parameter(text, schema)
    assert typed == value and type(typed) is type(value)


# -- pythonic ---------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ('[weather(city="Oslo")]', Parsed("", (OSLO,))),
    ("[weather(city='Oslo'), clock()]\n", Parsed("", (OSLO, CLOCK))),
    ('  [weather(city="Köln", days=-2, threshold=1.5, hourly=True, note=None, fields=["a", ("b", 3)], '
     'where={"lat": 59.9})]',
     Parsed("", (ParsedCall("weather", '{"city": "Köln", "days": -2, "threshold": 1.5, "hourly": true, "note": null, '
                                       '"fields": ["a", ["b", 3]], "where": {"lat": 59.9}}'),))),
    ("[\n    weather(\n        city='Oslo',\n    ),\n]", Parsed("", (OSLO,))),
])
def test_pythonic_reads_a_list_of_calls_with_literal_arguments(text, expected):
    assert parse(PYTHONIC, text) == expected


@pytest.mark.parametrize("text", [
    "Paris is lovely in May.",
    'weather(city="Oslo")',  # a call, but not in a list
    '[weather("Oslo")]',  # positional: no name to give the value
    "[weather(city=city)]",  # a variable
    '[weather(**{"city": "Oslo"})]',
    '[os.system(command="ls")]',
    '[weather(city=__import__("os").getcwd())]',
    '[weather(city="Os" + "lo")]',
    '[weather(city=b"Oslo")]', "[weather(days={1, 2})]", "[weather(days=1+2j)]", "[weather(days=...)]",
    '[weather(city="Oslo")',  # cut by max_tokens
    '[weather(city="Oslo")] Done.',
    "[1, 2]", "[]", "[See the docs](https://example.com)",
])
def test_pythonic_text_that_is_not_a_list_of_literal_calls_is_content(text):
    assert parse(PYTHONIC, text) == Parsed(text, ())


def test_pythonic_arguments_are_read_never_run(tmp_path):
    marker = tmp_path / "ran"
    text = f"[weather(city=open({str(marker)!r}, 'w').write('x'))]"
    assert parse(PYTHONIC, text) == Parsed(text, ()) and not marker.exists()


# -- every format, streamed -------------------------------------------------------------


REPLIES = {
    MISTRAL: ['[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock[ARGS]{}', 'weather{"city": "Oslo"}clock{}',
              'Checking.[TOOL_CALLS]weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}',
              'Sure. [TOOL_CALLS][{"name": "clock", "arguments": {}}]', '{"name": "clock", "arguments": {}}',
              "Yes, weather{} is a call's shape.", "Hi [TOOL_CALLS]weather[ARGS]{", "[1, 2]", "Yes"],
    QWEN3_CODER: ["Checking.\n" + xml_call("weather", city="Oslo", days="2") + "\n" + xml_call("clock"),
                  "See <function=clock>\n</function>", "a <b>bold</b> <tool answer", "<tool_call>\n<function=x>\n",
                  xml_call("weather", city="Oslo") + " trailing"],
    PYTHONIC: ['[weather(city="Oslo"), clock()]', " [clock()]", "[link](x) is markdown", "Plain answer."],
    HERMES: ['Sure <tool_call>{"name": "clock", "arguments": {}}</tool_call>', "a<b>c</b>"],
    LLAMA3_JSON: ['<|python_tag|>{"name": "clock", "parameters": {}}', "Hi there"],
    GRANITE: ['<|tool_call|>[{"name": "clock", "arguments": {}}]', '{"name": "clock", "arguments": {}}', "Hi [x]"],
}
CASES = [(parser, text) for parser, texts in REPLIES.items() for text in texts]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


@pytest.mark.parametrize(("parser", "text"), CASES)
def test_no_prefix_streams_content_the_whole_reply_reads_as_a_call(parser, text):
    tool_parser = parser_for(parser, SCHEMAS)
    assert tool_parser is not None
    ends = [tool_parser.content_end(text[:size]) for size in range(len(text) + 1)]
    assert all(end <= size for size, end in enumerate(ends))
    assert all(a <= b for a, b in itertools.pairwise(ends)), ends  # what was streamed is never taken back
    whole = tool_parser.parse(text)
    content = whole.content if whole.calls else text
    assert content.startswith(text[:max(ends[:-1], default=0)])


@pytest.mark.parametrize(("parser", "text"), CASES)
def test_a_reply_streamed_a_character_at_a_time_ends_as_the_whole_reply_does(parser, text):
    streamed, whole = (ToolCallSplitter(ChatTools(AUTO, schemas=SCHEMAS), ids()) for _ in range(2))
    pieces = [streamed.feed(char, i == len(text) - 1, parser) for i, char in enumerate(text)]
    assert whole.feed(text, True, parser)[0] == "".join(content for content, _ in pieces)
    assert streamed.calls == whole.calls and streamed.message() == whole.message()
