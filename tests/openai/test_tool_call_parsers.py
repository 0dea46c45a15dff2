"""The tool-call formats of 2026's models, read as vLLM's parsers of the same names read them:
Mistral's tokenizer v11+ calls (`name[ARGS]{...}`, its markers kept or dropped).
Every reply, old formats' included, is also streamed a character at a time: no prefix ever sends as
content what the whole reply reads as a call, and the stream ends where the whole reply does."""

from __future__ import annotations

import itertools

import pytest

from services.common.tool_call_formats import GRANITE, HERMES, LLAMA3_JSON, MISTRAL
from services.gateway.fronts.tool_call_parsers import PARSERS, Parsed, ParsedCall, parser_for
from services.gateway.fronts.tool_calls import AUTO, ChatTools, ToolCallSplitter

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


# -- every format, streamed -------------------------------------------------------------


REPLIES = {
    MISTRAL: ['[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]clock[ARGS]{}', 'weather{"city": "Oslo"}clock{}',
              'Checking.[TOOL_CALLS]weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}',
              'Sure. [TOOL_CALLS][{"name": "clock", "arguments": {}}]', '{"name": "clock", "arguments": {}}',
              "Yes, weather{} is a call's shape.", "Hi [TOOL_CALLS]weather[ARGS]{", "[1, 2]", "Yes"],
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
