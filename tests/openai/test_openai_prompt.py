"""echo and prompt_logprobs on the OpenAI front, as plain functions: what goes upstream, and the
shapes that come back (OpenAI's legacy echo logprobs, vLLM's prompt_logprobs), whole and streamed."""

from __future__ import annotations

import math

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.gateway.fronts import openai_choices, openai_codec
from services.gateway.fronts.openai_choices import ChoiceResult


def _position(token_id: int, text: bytes, logprob: float, *top: tuple[int, bytes, float]) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, token_bytes=text),
        top=[common_pb2.TokenLogprob(token_id=i, logprob=lp, token_bytes=t) for i, t, lp in top])


# The prompt "ab" as the scheduler sends it: its first token has no logprob (NaN), no alternatives.
PROMPT = [_position(97, b"a", math.nan), _position(98, b"b", -1.25, (99, b"c", -0.5), (98, b"b", -1.25))]
OUTPUT = [_position(100, b"d", -0.75, (100, b"d", -0.75), (101, b"e", -1.0))]
LAST = gateway_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                    usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=1))


def _result(text: str = "d") -> ChoiceResult:
    return ChoiceResult([text], list(OUTPUT), LAST, prompt_logprobs=list(PROMPT))


def test_echo_with_logprobs_asks_for_prompt_logprobs_with_as_many_alternatives():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 2})
    assert parsed.generate.sampling.prompt_logprobs == 2
    assert parsed.generate.sampling.HasField("prompt_logprobs")


@pytest.mark.parametrize(("body", "wanted"), [
    ({"echo": True}, None),  # the prompt's text alone: no logprobs to compute
    ({"logprobs": 3}, None),
    ({"prompt_logprobs": 0}, 0),
    ({"prompt_logprobs": 1, "echo": True, "logprobs": 4}, 4),
    ({"prompt_logprobs": 5, "echo": True, "logprobs": 0}, 5),
])
def test_what_goes_upstream_is_the_most_alternatives_any_view_needs(body, wanted):
    sampling = openai_codec.parse_completion({"model": "m", "prompt": "ab", **body}).generate.sampling
    assert (sampling.prompt_logprobs if sampling.HasField("prompt_logprobs") else None) == wanted


def test_echo_with_max_tokens_0_generates_one_token_upstream_and_returns_the_prompt_alone():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True, "max_tokens": 0,
                                            "logprobs": 1})
    assert parsed.generate.sampling.max_tokens == 1
    body = openai_codec.full_response(parsed, 1, [_result()])
    choice = body["choices"][0]
    assert choice["text"] == "ab"
    assert choice["logprobs"] == {"tokens": ["a", "b"], "token_logprobs": [None, -1.25],
                                  "top_logprobs": [None, {"c": -0.5, "b": -1.25}], "text_offset": [0, 1]}
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_echo_writes_the_prompt_then_the_completion_with_offsets_across_both():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1})
    body = openai_codec.full_response(parsed, 1, [_result()])
    choice = body["choices"][0]
    assert choice["text"] == "abd"
    assert choice["logprobs"] == {"tokens": ["a", "b", "d"], "token_logprobs": [None, -1.25, -0.75],
                                  "top_logprobs": [None, {"c": -0.5, "b": -1.25}, {"d": -0.75, "e": -1.0}],
                                  "text_offset": [0, 1, 2]}
    assert body["usage"]["completion_tokens"] == 1


def test_echo_without_logprobs_writes_text_only():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True})
    choice = openai_codec.full_response(parsed, 1, [_result()])["choices"][0]
    assert (choice["text"], choice["logprobs"]) == ("abd", None)


def test_vllm_prompt_logprobs_are_none_first_then_token_id_maps_with_ranks():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "prompt_logprobs": 1})
    choice = openai_codec.full_response(parsed, 1, [_result()])["choices"][0]
    assert choice["text"] == "d"  # no echo
    assert choice["prompt_logprobs"] == [None, {
        "99": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
        # The prompt token outside the k asked for: its rank is not reported.
        "98": {"logprob": -1.25, "rank": None, "decoded_token": "b"}}]


def test_chat_prompt_logprobs_go_at_the_top_as_vllm_puts_them():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "ab"}],
                                      "prompt_logprobs": 2})
    assert parsed.generate.sampling.prompt_logprobs == 2
    body = openai_codec.full_response(parsed, 1, [_result()])
    assert body["prompt_logprobs"][0] is None
    assert body["prompt_logprobs"][1]["98"] == {"logprob": -1.25, "rank": 2, "decoded_token": "b"}


def test_a_streamed_echo_puts_the_prompt_on_each_choices_first_event_only():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 0,
                                            "stream": True, "prompt_logprobs": 0})
    writer = openai_codec.LogprobsWriter(parsed)
    first = gateway_pb2.GenerateResponse(text="d", logprobs=OUTPUT, prompt_logprobs=PROMPT)
    second = gateway_pb2.GenerateResponse(text="e", logprobs=OUTPUT, finish_reason=common_pb2.FINISH_REASON_LENGTH)
    events = [openai_codec.stream_chunk(parsed, 1, first, True, writer, prompt=PROMPT)["choices"][0],
              openai_codec.stream_chunk(parsed, 1, second, False, writer, prompt=PROMPT)["choices"][0]]
    assert [e["text"] for e in events] == ["abd", "e"]
    assert events[0]["logprobs"]["tokens"] == ["a", "b", "d"]
    assert events[1]["logprobs"]["text_offset"] == [3]
    assert events[0]["prompt_logprobs"] == [None, {"98": {"logprob": -1.25, "rank": None, "decoded_token": "b"}}]
    assert "prompt_logprobs" not in events[1]


def test_only_the_first_choice_asks_for_prompt_logprobs():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 1, "n": 3})
    requests = openai_choices.choice_requests(parsed.generate, 3)
    assert [r.sampling.HasField("prompt_logprobs") for r in requests] == [True, False, False]


def test_every_choice_echoes_the_first_choices_prompt_logprobs():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "ab", "echo": True, "logprobs": 0, "n": 2})
    other = ChoiceResult(["e"], list(OUTPUT), LAST)
    choices = openai_codec.full_response(parsed, 1, [_result(), other])["choices"]
    assert [c["logprobs"]["tokens"][:2] for c in choices] == [["a", "b"], ["a", "b"]]


@pytest.mark.parametrize(("parse", "body", "param"), [
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo"),
    (openai_codec.parse_completion, {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    (openai_codec.parse_completion, {"prompt": "a", "prompt_logprobs": True}, "prompt_logprobs"),
    (openai_codec.parse_completion, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
])
def test_bad_prompt_options_are_refused_naming_the_parameter(parse, body, param):
    with pytest.raises(openai_codec.BadParameter) as caught:
        parse({"model": "m", **body})
    assert caught.value.param == param


CHAT = {"messages": [{"role": "user", "content": "a"}]}


@pytest.mark.parametrize(("parse", "body", "param", "message"), [
    (openai_codec.parse_completion, {"prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs",
     "Requested prompt logprobs of -1 (every token of the model's vocabulary), which is greater than max "
     "allowed: 20"),
    (openai_codec.parse_chat, {**CHAT, "prompt_logprobs": -1}, "prompt_logprobs", "Requested prompt logprobs of -1"),
    (openai_codec.parse_chat, {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
     "Requested sample logprobs of -1 (every token of the model's vocabulary), which is greater than max "
     "allowed: 20"),
    (openai_codec.parse_chat, {**CHAT, "top_logprobs": -1}, "top_logprobs", "top_logprobs needs logprobs: true"),
    # vLLM's completions refuse logprobs -1 before counting it ("must be a positive value").
    (openai_codec.parse_completion, {"prompt": "a", "logprobs": -1}, "logprobs",
     "logprobs must be an integer in [0, 20], got -1"),
    (openai_codec.parse_completion, {"prompt": "a", "prompt_logprobs": -2}, "prompt_logprobs",
     "prompt_logprobs must be an integer in [0, 20], got -2"),
])
def test_minus_one_the_whole_vocabulary_is_refused_past_max_logprobs_as_vllm_refuses_it(parse, body, param,
                                                                                       message):
    with pytest.raises(openai_codec.BadParameter) as caught:
        parse({"model": "m", **body})
    assert caught.value.param == param and message in str(caught.value)
