"""Issue 39's newest options at their edges, as plain functions (no processes): echo with
max_tokens 0 however its one upstream token ended, grammars that match no string, and
parallel_tool_calls' type on either endpoint."""

from __future__ import annotations

import dataclasses

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.gateway.fronts import openai_codec
from services.gateway.fronts.openai_choices import ChoiceResult
from services.scheduler.structured_output import compile_grammar

ECHO_ONLY = {"model": "m", "prompt": "ab", "echo": True, "max_tokens": 0}


def _last(reason: int) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(text="d", finish_reason=reason,
                                        usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1))


# The one token generated upstream for echo with max_tokens 0 may be the end of sequence, or end a
# stop string: what the client sees is the prompt alone, cut by max_tokens 0, so "length" all the same.
@pytest.mark.parametrize("reason", [common_pb2.FINISH_REASON_EOS, common_pb2.FINISH_REASON_STOP,
                                    common_pb2.FINISH_REASON_LENGTH])
def test_echo_with_max_tokens_0_finishes_by_length_however_the_dropped_token_ended(reason):
    parsed = openai_codec.parse_completion(ECHO_ONLY)
    whole = openai_codec.full_response(parsed, 1, [ChoiceResult(["d"], [], _last(reason))])
    assert (whole["choices"][0]["text"], whole["choices"][0]["finish_reason"]) == ("ab", "length")
    streamed = openai_codec.stream_chunk(dataclasses.replace(parsed, stream=True), 1, _last(reason), True)
    assert (streamed["choices"][0]["text"], streamed["choices"][0]["finish_reason"]) == ("ab", "length")


def test_echo_with_max_tokens_0_leaves_a_streams_earlier_events_unfinished():
    parsed = dataclasses.replace(openai_codec.parse_completion(ECHO_ONLY), stream=True)
    first = openai_codec.stream_chunk(parsed, 1, gateway_pb2.GenerateResponse(text="d"), True)
    assert (first["choices"][0]["text"], first["choices"][0]["finish_reason"]) == ("ab", None)


# No string is in these languages: a rule that only refers to itself, or a character class of nothing.
@pytest.mark.parametrize(("kind", "spec"), [
    ("grammar", "start: start"),
    ("grammar", "root ::= root"),
    ("grammar", "root ::= x\nx ::= x x"),
    ("grammar", 'start: a\na: a "x"'),
    ("grammar", "start: /[^\\x00-\\U0010FFFF]/"),
    ("regex", "[^\\x00-\\U0010FFFF]"),
])
def test_a_grammar_or_regex_that_matches_no_string_is_refused_at_admission(kind, spec):
    with pytest.raises(errors.InvalidArgument) as caught:
        compile_grammar(kind, spec)
    assert caught.value.message.startswith(f"sampling.structured: invalid {kind}: it matches no string")


@pytest.mark.parametrize(("kind", "spec"), [
    ("grammar", 'start: ""'),  # the empty string alone: the output ends at once
    ("grammar", 'root ::= "a"*'),
    ("grammar", 'root ::= answer " " number\nanswer ::= "yes" | "no"\nnumber ::= [1-9] [0-9]?'),
    ("grammar", 'start: "x" | "a" b\nb: "a" b'),  # one branch can never end; the other can
    ("regex", "[a-z]+"),
])
def test_grammars_with_some_string_still_compile(kind, spec):
    assert compile_grammar(kind, spec)


@pytest.mark.parametrize("path", ["completion", "chat"])
@pytest.mark.parametrize("value", ["false", 0, 1, [], {}])
def test_parallel_tool_calls_must_be_a_boolean_on_either_endpoint(path, value):
    body = {"model": "m", "parallel_tool_calls": value}
    body.update({"prompt": "a"} if path == "completion" else {"messages": [{"role": "user", "content": "a"}]})
    parse = openai_codec.parse_completion if path == "completion" else openai_codec.parse_chat
    with pytest.raises(openai_codec.BadParameter) as caught:
        parse(body)
    assert caught.value.param == "parallel_tool_calls"
    assert caught.value.message == f"parallel_tool_calls must be a boolean, got {value!r}"


@pytest.mark.parametrize("value", [True, False, None])
def test_a_boolean_parallel_tool_calls_is_harmless_on_completions(value):
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a", "parallel_tool_calls": value})
    assert parsed.tools is None and not parsed.generate.tools


TOOLS = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}]


# The scheduler refuses ignore_eos with a structured output (the output ends where its grammar
# does); its message names sampling fields, so the front refuses first, naming the parameter.
@pytest.mark.parametrize(("body", "named"), [
    ({"prompt": "a", "guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ({"prompt": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "a"}], "guided_regex": "a+"}, "guided_regex"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": TOOLS, "tool_choice": "required"},
     "a tool_choice that constrains the output"),
])
def test_ignore_eos_with_a_structured_output_is_a_400_naming_ignore_eos(body, named):
    parse = openai_codec.parse_completion if "prompt" in body else openai_codec.parse_chat
    with pytest.raises(openai_codec.BadParameter) as caught:
        parse({"model": "m", "ignore_eos": True, **body})
    assert caught.value.param == "ignore_eos"
    assert caught.value.message == f"ignore_eos cannot be combined with {named}: a structured output ends where " \
                                   "its grammar does"


def test_ignore_eos_with_tools_the_model_may_call_or_not_is_accepted():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "tools": TOOLS,
                                      "ignore_eos": True})
    assert parsed.generate.sampling.ignore_eos and not parsed.generate.sampling.HasField("structured")
