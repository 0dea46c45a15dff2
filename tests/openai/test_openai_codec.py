"""openai_codec and the priority header, as plain functions (no processes)."""

from __future__ import annotations

import json

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.common.priority import Priority
from services.gateway.calls.generate_core import parse_priority
from services.gateway.fronts import openai_choices, openai_codec
from services.gateway.fronts.caller import timeout_s_of
from services.gateway.fronts.openai_choices import ChoiceResult
from services.gateway.quota.quotas import QuotaExceeded


def test_chat_goes_upstream_as_its_messages_with_text_parts_joined_and_no_prompt():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": ""}]})
    assert parsed.generate.prompt == ""
    assert [(m.role, m.content) for m in parsed.generate.messages] == [
        ("system", "Be brief."), ("user", "Hi there"), ("assistant", "")]


@pytest.mark.parametrize(("messages", "param", "message"), [
    (None, "messages", "messages must be a non-empty list of {role, content} objects"),
    ([], "messages", "messages must be a non-empty list of {role, content} objects"),
    (["hi"], "messages[0]", "messages[0] must be an object"),
    ([{"role": "robot", "content": "x"}], "messages[0].role",
     "messages[0].role must be one of system, developer, user, assistant, tool, got 'robot'"),
    ([{"role": "user", "content": 3}], "messages[0].content",
     "messages[0].content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content",
     "messages[0].content parts must be {type: text, text: ...}; images and audio are not supported"),
])
def test_chat_messages_are_checked_before_they_go_upstream(messages, param, message):
    with pytest.raises(openai_codec.BadParameter) as caught:
        openai_codec.parse_chat({"model": "m", "messages": messages})
    assert (caught.value.param, caught.value.message) == (param, message)


def test_completion_fields_become_sampling_params():
    parsed = openai_codec.parse_completion({"model": "tinylm:2", "prompt": ["abc"], "max_tokens": 5, "top_p": 0.5,
                                            "stop": "x", "seed": 3, "stream": True,
                                            "stream_options": {"include_usage": True}, "ignore_eos": True})
    assert (parsed.generate.model.name, parsed.generate.model.version, parsed.generate.prompt) == ("tinylm", "2", "abc")
    sampling = parsed.generate.sampling
    assert (sampling.max_tokens, sampling.top_p, list(sampling.stop), sampling.seed, sampling.ignore_eos) == (
        5, 0.5, ["x"], 3, True)
    assert sampling.temperature == 1.0, "OpenAI's default temperature"
    assert (parsed.stream, parsed.include_usage, parsed.model) == (True, True, "tinylm:2")


def test_defaults_are_accepted_and_non_defaults_refused():
    body = {"model": "m", "prompt": "a", "n": 1, "echo": False, "presence_penalty": 0, "logit_bias": {},
            "tools": [], "tool_choice": "none", "logprobs": None, "response_format": {"type": "text"}}
    assert openai_codec.parse_completion(body).generate.prompt == "a"
    with pytest.raises(openai_codec.BadParameter) as caught:
        openai_codec.parse_completion({"model": "m", "prompt": "a", "n": True})
    assert caught.value.param == "n"


def test_penalties_and_logit_bias_become_sampling_params():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                      "presence_penalty": -0.5, "frequency_penalty": 1, "repetition_penalty": 1.1,
                                      "logit_bias": {"50256": -100, "7": 2.5}})
    sampling = parsed.generate.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (-0.5, 1.0)
    assert sampling.repetition_penalty == pytest.approx(1.1)
    assert dict(sampling.logit_bias) == {50256: -100.0, 7: 2.5}
    plain = openai_codec.parse_completion({"model": "m", "prompt": "a"}).generate.sampling
    assert (plain.presence_penalty, plain.repetition_penalty, dict(plain.logit_bias)) == (0.0, 1.0, {})


def test_vllms_top_k_min_p_and_min_tokens_become_sampling_params():
    sampling = openai_codec.parse_completion({"model": "m", "prompt": "a", "top_k": 20, "min_p": 0.05}).generate.sampling
    assert (sampling.top_k, sampling.min_p) == (20, pytest.approx(0.05))
    for off in (-1, 0, None):
        assert openai_codec.parse_completion({"model": "m", "prompt": "a", "top_k": off}).generate.sampling.top_k == 0
    assert openai_codec.parse_completion({"model": "m", "prompt": "a", "min_tokens": 0}).generate.sampling.min_tokens == 0
    assert openai_codec.parse_completion({"model": "m", "prompt": "a", "min_tokens": 9}).generate.sampling.min_tokens == 9
    chat = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                    "max_completion_tokens": 5, "min_tokens": 5})
    assert (chat.generate.sampling.min_tokens, chat.generate.sampling.max_tokens) == (5, 5)
    for body, param, message in (({"top_k": -2}, "top_k", "top_k must be an integer in [-1, 1000000] (-1 and 0: off)"),
                                 ({"top_k": 2.5}, "top_k", "got 2.5"), ({"top_k": True}, "top_k", "got True"),
                                 ({"min_p": 1.5}, "min_p", "min_p must be a number in [0, 1], got 1.5"),
                                 ({"min_tokens": -1}, "min_tokens", "min_tokens must be an integer in [0, 4294967295]"),
                                 ({"min_tokens": 1.5}, "min_tokens", "got 1.5"),
                                 ({"min_tokens": 9, "max_tokens": 8}, "min_tokens",
                                  "min_tokens (9) must be at most max_tokens (8)")):
        with pytest.raises(openai_codec.BadParameter) as caught:
            openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], **body})
        assert caught.value.param == param and message in str(caught.value)


def test_the_schedulers_logit_bias_refusal_names_the_parameter():
    reply = openai_codec.error_reply(errors.InvalidArgument("sampling.logit_bias: token id 9 is not a token"))
    assert (reply.status, reply.body["error"]["param"]) == (400, "logit_bias")
    reply = openai_codec.error_reply(errors.InvalidArgument("sampling.min_tokens (200) must be at most the default "
                                                            "max_tokens (128)"))
    assert (reply.status, reply.body["error"]["param"]) == (400, "min_tokens")
    assert openai_codec.error_reply(errors.InvalidArgument("sampling.top_p bad")).body["error"]["param"] is None


def test_chat_prefers_max_completion_tokens():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                      "max_tokens": 9, "max_completion_tokens": 4})
    assert parsed.generate.sampling.max_tokens == 4


@pytest.mark.parametrize(("error", "status", "kind", "retry_after"), [
    (QuotaExceeded("over", "requests_per_s", retry_after_s=0.2), 429, "rate_limit_error", 1),
    (errors.ResourceExhausted("shed", retry_after_s=2.5), 503, "overloaded_error", 3),
    (errors.Unavailable("no worker"), 503, "service_unavailable_error", None),
    (errors.DeadlineExceeded("late"), 504, "timeout_error", None),
    (errors.Internal("bug"), 500, "internal_error", None),
])
def test_error_table(error, status, kind, retry_after):
    reply = openai_codec.error_reply(error)
    assert (reply.status, reply.body["error"]["type"], reply.refusal.retry_after_s) == (status, kind, retry_after)


def test_last_stream_chunk_carries_finish_reason_and_timings():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}], "stream": True})
    parsed.generate.request_id = "r1"
    last = gateway_pb2.GenerateResponse(text="", finish_reason=common_pb2.FINISH_REASON_EOS,
                                        timings=common_pb2.Timings(total_us=1500, stages=[common_pb2.StageTiming(
                                            stage=common_pb2.STAGE_ADMISSION, duration_us=500, service="gateway")]))
    event = openai_codec.stream_chunk(parsed, 1, last, first=False)
    assert event["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": None}
    assert event["infermesh"]["timings"] == {"total_us": 1500, "stages": [
        {"service": "gateway", "stage": "admission", "duration_us": 500}]}
    assert openai_codec.timings_header(last) == "gateway.admission;dur=0.500, total;dur=1.500"


@pytest.mark.parametrize(("value", "priority"), [
    (None, None), ("", None), ("Sheddable", Priority.SHEDDABLE), (b"critical", Priority.CRITICAL),
])
def test_priority_header(value, priority):
    assert parse_priority(value) is priority


def test_an_unknown_priority_is_invalid():
    with pytest.raises(errors.InvalidArgument, match="x-infermesh-priority must be one of critical, standard, "
                                                     "sheddable, got 'urgent'"):
        parse_priority("urgent")


@pytest.mark.parametrize(("parse", "body", "param"), [
    (openai_codec.parse_completion, {"prompt": "a", "logprobs": -1}, "logprobs"),
    (openai_codec.parse_completion, {"prompt": "a", "logprobs": 21}, "logprobs"),
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 1}, "top_logprobs"),
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "logprobs": "yes"}, "logprobs"),
])
def test_bad_logprobs_are_refused_naming_the_parameter(parse, body, param):
    with pytest.raises(openai_codec.BadParameter) as caught:
        parse({"model": "m", **body})
    assert caught.value.param == param


@pytest.mark.parametrize(("parse", "body", "wanted"), [
    (openai_codec.parse_completion, {"prompt": "a", "logprobs": 0}, (True, 0)),
    (openai_codec.parse_completion, {"prompt": "a", "logprobs": 5}, (True, 5)),
    (openai_codec.parse_completion, {"prompt": "a"}, (False, 0)),
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "logprobs": True}, (True, 0)),
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                               "top_logprobs": 20}, (True, 20)),
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "logprobs": False,
                               "top_logprobs": 0}, (False, 0)),
])
def test_logprobs_become_sampling_params(parse, body, wanted):
    sampling = parse({"model": "m", **body}).generate.sampling
    assert (sampling.logprobs, sampling.top_logprobs) == wanted


def _position(token: bytes, logprob: float, *top: tuple[bytes, float]) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=token[0], logprob=logprob, token_bytes=token),
        top=[common_pb2.TokenLogprob(token_id=t[0], logprob=lp, token_bytes=t) for t, lp in top])


POSITIONS = [_position(b"Hi", -0.5, (b"Hi", -0.5), (b"Yo", -1.5)), _position(b"\xc3", -2.0, (b"!", -0.25))]


def test_chat_logprobs_in_openais_shape():
    parsed = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                      "logprobs": True, "top_logprobs": 2})
    last = gateway_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    result = ChoiceResult(["Hi\ufffd"], list(POSITIONS), last)
    choice = openai_codec.full_response(parsed, 1, [result])["choices"][0]
    assert choice["logprobs"] == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}, {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]},
        {"token": "\ufffd", "logprob": -2.0, "bytes": [195], "top_logprobs": [
            {"token": "!", "logprob": -0.25, "bytes": [33]}]},
    ]}


def test_streamed_completion_logprobs_count_text_offsets_across_chunks():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a", "logprobs": 1, "stream": True})
    writer = openai_codec.LogprobsWriter(parsed)
    first = gateway_pb2.GenerateResponse(text="Hi", logprobs=POSITIONS[:1])
    second = gateway_pb2.GenerateResponse(text="\ufffd", logprobs=POSITIONS[1:],
                                          finish_reason=common_pb2.FINISH_REASON_LENGTH)
    events = [openai_codec.stream_chunk(parsed, 1, first, True, writer),
              openai_codec.stream_chunk(parsed, 1, second, False, writer)]
    assert [e["choices"][0]["logprobs"] for e in events] == [
        {"tokens": ["Hi"], "token_logprobs": [-0.5], "top_logprobs": [{"Hi": -0.5, "Yo": -1.5}], "text_offset": [0]},
        # The sampled token is always among top_logprobs (OpenAI: up to logprobs + 1 entries).
        {"tokens": ["\ufffd"], "token_logprobs": [-2.0], "top_logprobs": [{"!": -0.25, "\ufffd": -2.0}],
         "text_offset": [2]},
    ]


def test_no_logprobs_asked_none_written():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a"})
    last = gateway_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
    assert openai_codec.full_response(parsed, 1, [ChoiceResult(["x"], [], last)])["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("model", ["tinylm:", ":", ":2"])
def test_a_model_id_with_an_empty_name_or_version_is_refused_naming_model(model):
    with pytest.raises(openai_codec.BadParameter,
                       match=f"model must be a model id or <id>:<version>, got '{model}'") as caught:
        openai_codec.parse_completion({"model": model, "prompt": "a"})
    assert caught.value.param == "model"


@pytest.mark.parametrize(("value", "timeout_s"), [(None, None), ("1500", 1.5), ("2.5", 0.0025)])
def test_the_timeout_header_is_plain_decimal_milliseconds(value, timeout_s):
    assert timeout_s_of(value) == timeout_s


@pytest.mark.parametrize("value", ["1_000", "1e3", " 100", "inf", "nan", "0x10", "", "1" * 400])
def test_a_timeout_header_that_is_not_plain_decimal_is_refused(value):
    with pytest.raises(openai_codec.BadParameter, match="x-infermesh-timeout-ms must be a number of milliseconds"):
        timeout_s_of(value)


@pytest.mark.parametrize(("parse", "body", "param", "message"), [
    (openai_codec.parse_completion, {"prompt": "a", "n": 17}, "n", "n must be an integer in [1, 16], got 17"),
    (openai_codec.parse_completion, {"prompt": "a", "n": 0}, "n", "n must be an integer in [1, 16], got 0"),
    (openai_codec.parse_completion, {"prompt": "a", "n": True}, "n", "n must be an integer in [1, 16], got True"),
    (openai_codec.parse_completion, {"prompt": "a", "n": 3, "best_of": 2}, "best_of",
     "best_of must be >= n (3), got 2"),
    (openai_codec.parse_completion, {"prompt": "a", "best_of": 2, "stream": True}, "best_of",
     "best_of > n cannot be streamed: the best choices are known at the end"),
    (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}], "best_of": 2}, "best_of",
     "best_of is a completions parameter"),
])
def test_bad_choice_counts_are_refused_naming_the_parameter(parse, body, param, message):
    with pytest.raises(openai_codec.BadParameter) as caught:
        parse({"model": "m", **body})
    assert (caught.value.param, caught.value.message) == (param, message)


def test_choices_get_their_own_request_ids_and_seeds():
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a", "n": 2, "best_of": 3, "seed": 2**63 - 2})
    assert (parsed.n, parsed.best_of, parsed.logprobs, parsed.generate.sampling.logprobs) == (2, 3, False, True)
    requests = openai_choices.choice_requests(parsed.generate, parsed.best_of)
    assert [r.request_id for r in requests] == [f"{parsed.generate.request_id}-{i}" for i in range(3)]
    assert [r.sampling.seed for r in requests] == [2**63 - 2, 2**63 - 1, 0]
    unseeded = openai_codec.parse_completion({"model": "m", "prompt": "a", "n": 2})
    assert not any(r.sampling.HasField("seed") for r in openai_choices.choice_requests(unseeded.generate, 2))
    single = openai_codec.parse_completion({"model": "m", "prompt": "a"})
    assert openai_choices.choice_requests(single.generate, 1) == [single.generate]


def test_usage_counts_the_prompt_once_and_every_choices_tokens():
    def last(prompt, completion, cached):
        return gateway_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=common_pb2.Usage(
            prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached))
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a", "n": 1, "best_of": 3, "logprobs": 0})
    results = [ChoiceResult(["a"], [_position(b"a", lp)], last(10, 4, 0)) for lp in (-2.0, -0.5, -1.0)]
    body = openai_codec.full_response(parsed, 1, openai_choices.best(results, 1), results)
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert [c["logprobs"]["token_logprobs"] for c in body["choices"]] == [[-0.5]]


def test_best_of_ranks_by_mean_logprob_per_token_ties_to_the_lower_index():
    def result(*logprobs):
        return ChoiceResult([], [_position(b"x", lp) for lp in logprobs])
    results = [result(-1.0, -1.0), result(-0.2, -1.6, -1.0, -0.2), result(-0.5), result(), result(-1.0)]
    assert openai_choices.best(results, 5) == [results[2], results[1], results[0], results[4], results[3]]


@pytest.mark.parametrize(("body", "kind", "value"), [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "json_schema", '{"type": "object"}'),
    ({"guided_json": '{"type": "integer"}'}, "json_schema", '{"type": "integer"}'),
    ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, "grammar", 'root ::= "yes" | "no"'),
])
def test_structured_output_becomes_sampling_structured(body, kind, value):
    parsed = openai_codec.parse_completion({"model": "m", "prompt": "a", **body})
    structured = parsed.generate.sampling.structured
    assert structured.WhichOneof("kind") == kind
    got = list(structured.choice.choices) if kind == "choice" else getattr(structured, kind)
    assert got == value
    assert parsed.structured_param == next(iter(body))


def test_text_response_format_is_free_text_and_the_schedulers_refusal_names_the_parameter():
    plain = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                     "response_format": {"type": "text"}})
    assert not plain.generate.sampling.HasField("structured") and plain.structured_param is None
    guided = openai_codec.parse_completion({"model": "m", "prompt": "a", "guided_regex": "[a-"})
    refusal = openai_codec.upstream_refusal(errors.InvalidArgument("sampling.structured: invalid regex"), guided)
    assert openai_codec.error_reply(refusal).body["error"]["param"] == "guided_regex"


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_grammar": " \n"}, "guided_grammar"),
    ({"guided_grammar": {"root": "a"}}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "guided_grammar": "start: \"a\""}, "guided_grammar"),
])
def test_bad_structured_output_is_refused_naming_the_parameter(body, param):
    with pytest.raises(openai_codec.BadParameter) as caught:
        openai_codec.parse_completion({"model": "m", "prompt": "a", **body})
    assert caught.value.param == param


def test_vllms_chat_options_travel_with_the_conversation():
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "Su"}]
    plain = openai_codec.parse_chat({"model": "m", "messages": messages}).generate
    assert (plain.HasField("add_generation_prompt"), plain.continue_final_message, plain.chat_template_kwargs) == \
        (False, False, "")
    opened = openai_codec.parse_chat({"model": "m", "messages": messages, "add_generation_prompt": False,
                                      "continue_final_message": True,
                                      "chat_template_kwargs": {"enable_thinking": False, "note": "é"}}).generate
    assert (opened.add_generation_prompt, opened.continue_final_message) == (False, True)
    assert json.loads(opened.chat_template_kwargs) == {"enable_thinking": False, "note": "é"}
    for body, param in (({"continue_final_message": True}, "continue_final_message"),
                        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                        ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs")):
        with pytest.raises(openai_codec.BadParameter) as caught:
            openai_codec.parse_chat({"model": "m", "messages": messages, **body})
        assert caught.value.param == param
    reply = openai_codec.error_reply(errors.InvalidArgument("chat_template_kwargs.tools: set by the request itself"))
    assert (reply.status, reply.body["error"]["param"]) == (400, "chat_template_kwargs")


def test_vllms_stop_token_ids_and_include_stop_str_in_output():
    sampling = openai_codec.parse_completion({"model": "m", "prompt": "a", "stop_token_ids": [7, 128009],
                                              "include_stop_str_in_output": True}).generate.sampling
    assert (list(sampling.stop_token_ids), sampling.include_stop_str_in_output) == ([7, 128009], True)
    for value in (7, [-1], ["7"], list(range(65))):
        with pytest.raises(openai_codec.BadParameter) as caught:
            openai_codec.parse_completion({"model": "m", "prompt": "a", "stop_token_ids": value})
        assert caught.value.param == "stop_token_ids"
    reply = openai_codec.error_reply(errors.InvalidArgument("sampling.stop_token_ids[0] is 9999999, but the model's"))
    assert reply.body["error"]["param"] == "stop_token_ids"


def test_vllms_allowed_token_ids_and_bad_words_reach_the_sampling_params():
    for parse, body in ((openai_codec.parse_completion, {"prompt": "a"}),
                        (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}]})):
        sampling = parse({"model": "m", **body, "allowed_token_ids": [5, 3, 5],
                          "bad_words": [" hello", "big cat"]}).generate.sampling
        assert list(sampling.allowed_token_ids) == [5, 3, 5]  # as given: the scheduler sorts and dedupes
        assert list(sampling.bad_words) == [" hello", "big cat"]
    plain = openai_codec.parse_completion({"model": "m", "prompt": "a", "bad_words": []}).generate.sampling
    assert not plain.bad_words and not plain.allowed_token_ids


@pytest.mark.parametrize(("field", "value"), [
    ("allowed_token_ids", []), ("allowed_token_ids", 7), ("allowed_token_ids", [-1]), ("allowed_token_ids", ["7"]),
    ("allowed_token_ids", [1.5]), ("allowed_token_ids", [True]), ("allowed_token_ids", list(range(4097))),
    ("bad_words", "word"), ("bad_words", [3]), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [None]),
    ("bad_words", ["w"] * 129),
])
def test_bad_allowed_token_ids_and_bad_words_are_a_400_naming_the_field(field, value):
    with pytest.raises(openai_codec.BadParameter) as caught:
        openai_codec.parse_completion({"model": "m", "prompt": "a", field: value})
    assert caught.value.param == field


def test_the_schedulers_refusals_of_allowed_token_ids_and_bad_words_name_the_field():
    for field, message in (("allowed_token_ids", "sampling.allowed_token_ids[1] is 99999, but the model's"),
                           ("bad_words", "sampling.bad_words[0] must be 1-256 bytes of UTF-8")):
        reply = openai_codec.error_reply(errors.InvalidArgument(message))
        assert (reply.status, reply.body["error"]["param"]) == (400, field)


def test_vllms_add_special_tokens_and_truncate_prompt_tokens():
    plain = openai_codec.parse_completion({"model": "m", "prompt": "a"}).generate
    assert (plain.HasField("add_special_tokens"), plain.HasField("truncate_prompt_tokens")) == (False, False)
    asked = openai_codec.parse_completion({"model": "m", "prompt": "a", "add_special_tokens": False,
                                           "truncate_prompt_tokens": -1}).generate
    assert (asked.add_special_tokens, asked.truncate_prompt_tokens) == (False, -1)
    chat = openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                    "truncate_prompt_tokens": 100}).generate
    assert chat.truncate_prompt_tokens == 100
    for value in (0, -2, 1.5, True, "10"):
        with pytest.raises(openai_codec.BadParameter) as caught:
            openai_codec.parse_completion({"model": "m", "prompt": "a", "truncate_prompt_tokens": value})
        assert caught.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", True), ("length_penalty", 0.8),
    ("skip_special_tokens", False), ("chat_template", "{{ messages }}"), ("documents", [{"text": "d"}]),
    ("return_tokens_as_token_ids", True), ("prompt_embeds", "AAAA"),
    ("logits_processors", ["p"]), ("priority", 5), ("priority", -1), ("cache_salt", "user-7"),
])
def test_vllm_extensions_not_done_here_are_refused_not_ignored(field, value):
    for parse, body in ((openai_codec.parse_completion, {"prompt": "a"}),
                        (openai_codec.parse_chat, {"messages": [{"role": "user", "content": "a"}]})):
        with pytest.raises(openai_codec.BadParameter) as caught:
            parse({"model": "m", **body, field: value})
        assert caught.value.param == field
        parse({"model": "m", **body, field: None})  # absent or default: fine
    assert openai_codec.parse_chat({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                    "skip_special_tokens": True, "use_beam_search": False, "priority": 0,
                                    "cache_salt": ""})


def test_a_choices_token_ids_end_with_the_token_that_ended_it():
    result = ChoiceResult()
    result.add(gateway_pb2.GenerateResponse(token_ids=[5, 6], prompt_token_ids=[1, 2]))
    result.add(gateway_pb2.GenerateResponse(token_ids=[7], end_token_id=0,
                                            finish_reason=common_pb2.FINISH_REASON_EOS))
    assert (result.token_ids, result.prompt_token_ids) == ([5, 6, 7, 0], [1, 2])
    cut = ChoiceResult()
    cut.add(gateway_pb2.GenerateResponse(token_ids=[5], finish_reason=common_pb2.FINISH_REASON_LENGTH))
    assert cut.token_ids == [5]


def test_the_sampling_fields_a_body_leaves_out_are_left_to_the_models_recommendation():
    """As vLLM applies a model's generation_config.json: each field the body leaves out (or sends null)
    is listed for the scheduler, which uses the model's value where it has one (OpenAI's default sent
    here otherwise)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "top_p": 0.5, "min_p": None}
    request = openai_codec.parse_chat(body).generate
    assert list(request.model_default_fields) == [
        common_pb2.SAMPLING_FIELD_TEMPERATURE, common_pb2.SAMPLING_FIELD_TOP_K, common_pb2.SAMPLING_FIELD_MIN_P,
        common_pb2.SAMPLING_FIELD_REPETITION_PENALTY]
    assert (request.sampling.temperature, request.sampling.top_p) == (1.0, 0.5)
    every = openai_codec.parse_completion({"model": "m", "prompt": "p", "temperature": 0, "top_p": 1, "top_k": 0,
                                           "min_p": 0, "repetition_penalty": 1})
    assert not every.generate.model_default_fields
