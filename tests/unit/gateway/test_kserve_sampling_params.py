"""KServe generator requests take the OpenAI front's sampling options from their parameters, checked
by the same code (openai_params), and return logprobs as output tensors (issue 39)."""

from __future__ import annotations

import json
import struct

import pytest

from inference import grpc_predict_v2_pb2 as kserve
from infermesh.v1 import common_pb2, gateway_pb2
from services.common.errors import InvalidArgument
from services.gateway.fronts import kserve_http_codec
from services.gateway.fronts.openai_params import BadParameter
from services.gateway.kserve import stream as kserve_stream
from tests.unit.gateway.test_kserve_models import _stream_request


def _sampling(**parameters) -> common_pb2.SamplingParams:
    return kserve_stream.parse_stream_request(_stream_request(**parameters)).generate.sampling


def test_logprobs_penalties_and_logit_bias_are_read_as_the_openai_front_reads_them():
    sampling = _sampling(logprobs=True, top_logprobs=3, presence_penalty=0.5, frequency_penalty=-1,
                         repetition_penalty=1.3, logit_bias='{"5": -100, "17": 2.5}', max_tokens=4)
    assert (sampling.logprobs, sampling.top_logprobs, sampling.max_tokens) == (True, 3, 4)
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -1.0)
    assert sampling.repetition_penalty == pytest.approx(1.3)
    assert dict(sampling.logit_bias) == {5: -100.0, 17: 2.5}
    plain = _sampling()
    assert (plain.logprobs, plain.presence_penalty, plain.repetition_penalty, dict(plain.logit_bias)) == \
        (False, 0.0, 1.0, {})
    cut = _sampling(top_k=40, min_p=0.1)  # Triton's vLLM backend takes both as sampling parameters
    assert (cut.top_k, cut.min_p, plain.top_k, plain.min_p) == (40, pytest.approx(0.1), 0, 0.0)
    assert (_sampling(min_tokens=3).min_tokens, plain.min_tokens) == (3, 0)
    stops = _sampling(stop_token_ids="[5, 9]", include_stop_str_in_output=True)
    assert (list(stops.stop_token_ids), stops.include_stop_str_in_output) == ([5, 9], True)
    words = _sampling(allowed_token_ids="[3, 4]", bad_words='["cat", "big dog"]')
    assert (list(words.allowed_token_ids), list(words.bad_words)) == ([3, 4], ["cat", "big dog"])
    with pytest.raises(BadParameter) as caught:
        _sampling(allowed_token_ids="[]")
    assert caught.value.param == "allowed_token_ids"


@pytest.mark.parametrize("parameters, expected", [
    ({"guided_regex": "[0-9]{3}"}, common_pb2.StructuredOutput(regex="[0-9]{3}")),
    ({"guided_grammar": 'root ::= "a"+'}, common_pb2.StructuredOutput(grammar='root ::= "a"+')),
    ({"guided_choice": '["yes", "no"]'},
     common_pb2.StructuredOutput(choice=common_pb2.ChoiceList(choices=["yes", "no"]))),
    ({"guided_json": '{"type": "object"}'}, common_pb2.StructuredOutput(json_schema='{"type": "object"}')),
    ({"response_format": '{"type": "json_object"}'}, common_pb2.StructuredOutput(json_object=True)),
    ({"response_format": '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}'},
     common_pb2.StructuredOutput(json_schema='{"type": "array"}')),
])
def test_structured_output_parameters_set_sampling_structured(parameters, expected):
    parsed = kserve_stream.parse_stream_request(_stream_request(**parameters))
    assert parsed.generate.sampling.structured == expected
    assert parsed.structured_param == next(iter(parameters))


@pytest.mark.parametrize("parameters, param, fragment", [
    ({"logprobs": 1}, "logprobs", "logprobs must be a boolean"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs must be an integer in [0, 20]"),
    ({"presence_penalty": 3.0}, "presence_penalty", "presence_penalty must be a number in [-2, 2]"),
    ({"frequency_penalty": "high"}, "frequency_penalty", "frequency_penalty must be a number"),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be a number in (0, 2]"),
    ({"top_k": -3}, "top_k", "top_k must be an integer in [-1, 1000000]"),
    ({"min_p": 2.0}, "min_p", "min_p must be a number in [0, 1]"),
    ({"min_tokens": -3}, "min_tokens", "min_tokens must be an integer in [0, 4294967295]"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "min_tokens (9) must be at most max_tokens (8)"),
    ({"logit_bias": "{5: 1}"}, "logit_bias", "parameter 'logit_bias' must be JSON text"),
    ({"logit_bias": '{"a": 1}'}, "logit_bias", "logit_bias keys must be token ids"),
    ({"logit_bias": '{"5": 101}'}, "logit_bias", "logit_bias[5] must be a number in [-100, 100]"),
    ({"logit_bias": "[1]"}, "logit_bias", "logit_bias must be an object"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
    ({"guided_choice": '"yes"'}, "guided_choice", "guided_choice must be a list of 1 to 256 non-empty strings"),
    ({"guided_json": "not json"}, "guided_json", "guided_json must be a JSON schema"),
    ({"response_format": '{"type": "xml"}'}, "response_format", "response_format must be"),
    ({"guided_regex": "a", "guided_choice": '["a"]'}, "guided_choice", "set one of response_format"),
])
def test_a_bad_option_is_invalid_argument_naming_the_parameter(parameters, param, fragment):
    with pytest.raises(BadParameter) as refused:
        kserve_stream.parse_stream_request(_stream_request(**parameters))
    assert refused.value.param == param
    assert refused.value.message.startswith(f"parameter '{param}'") and fragment in refused.value.message


def test_an_unknown_parameter_lists_the_options_too():
    with pytest.raises(InvalidArgument, match="unknown parameter 'n'; .*logprobs, top_logprobs, .*guided_choice"):
        _sampling(n=2)


def _chunk(logprobs: list[tuple[int, float, list[tuple[int, bytes, float]]]], **fields) -> gateway_pb2.GenerateResponse:
    return gateway_pb2.GenerateResponse(
        text="ab", token_ids=[t for t, _, _ in logprobs], **fields,
        logprobs=[common_pb2.PositionLogprobs(
            token=common_pb2.TokenLogprob(token_id=t, logprob=lp),
            top=[common_pb2.TokenLogprob(token_id=i, token_bytes=b, logprob=v) for i, b, v in top])
            for t, lp, top in logprobs])


def _outputs(response: kserve.ModelInferResponse) -> dict[str, tuple[str, list[int], bytes]]:
    return {t.name: (t.datatype, list(t.shape), raw) for t, raw in zip(response.outputs, response.raw_output_contents,
                                                                        strict=True)}


def test_logprobs_come_back_as_an_fp32_tensor_and_top_logprobs_as_json_per_token():
    parsed = kserve_stream.parse_stream_request(_stream_request(logprobs=True, top_logprobs=2))
    chunk = _chunk([(7, -0.25, [(7, b"a", -0.25), (9, b"\xff", -2.0)]), (8, -0.5, [(8, b"b", -0.5), (1, b"c", -1.5)])])
    (response,) = kserve_stream.chunk_responses(parsed, chunk)
    outputs = _outputs(response)
    datatype, shape, raw = outputs["logprobs"]
    assert (datatype, shape, list(struct.unpack("<2f", raw))) == ("FP32", [2], [-0.25, -0.5])
    datatype, shape, raw = outputs["top_logprobs"]
    tops = [json.loads(e) for e in kserve_http_codec.unpack_bytes_tensor(raw)]
    assert (datatype, shape) == ("BYTES", [2])
    assert tops[0] == [{"token_id": 7, "token": "a", "logprob": -0.25}, {"token_id": 9, "token": "\ufffd", "logprob": -2.0}]
    assert [t["token_id"] for t in tops[1]] == [8, 1]
    only_logprobs = kserve_stream.parse_stream_request(_stream_request(logprobs=True))
    (response,) = kserve_stream.chunk_responses(only_logprobs, _chunk([(7, -0.25, [])]))
    assert set(_outputs(response)) == {"text_output", "logprobs"}
    (response,) = kserve_stream.chunk_responses(kserve_stream.parse_stream_request(_stream_request()), _chunk([]))
    assert set(_outputs(response)) == {"text_output"}


def test_the_schedulers_refusal_of_a_regex_names_the_parameter():
    parsed = kserve_stream.parse_stream_request(_stream_request(guided_regex="[a-"))
    named = kserve_stream.named_refusal(parsed, InvalidArgument("sampling.structured: invalid regex"))
    assert named.message == "parameter 'guided_regex': sampling.structured: invalid regex"
    other = InvalidArgument("sampling.logit_bias[99999] is not a token")
    assert kserve_stream.named_refusal(parsed, other) is other


def test_rest_generate_body_carries_json_values_as_json_text_parameters():
    body = {"id": "g-1", "text_input": "Hi", "parameters": {"max_tokens": 3, "logit_bias": {"5": 10},
                                                            "guided_choice": ["a", "b"], "logprobs": True}}
    request = kserve_http_codec.parse_generate(json.dumps(body).encode(), "tinylm", "")
    parsed = kserve_stream.parse_stream_request(request)
    assert (parsed.generate.prompt, parsed.id, dict(parsed.generate.sampling.logit_bias)) == ("Hi", "g-1", {5: 10.0})
    assert list(parsed.generate.sampling.structured.choice.choices) == ["a", "b"]
    with pytest.raises(InvalidArgument, match="unknown field 'prompt'"):
        kserve_http_codec.parse_generate(b'{"prompt": "Hi"}', "tinylm", "")
    with pytest.raises(InvalidArgument, match="'text_input' must be a string"):
        kserve_http_codec.parse_generate(b'{"text_input": 3}', "tinylm", "")
    with pytest.raises(InvalidArgument, match="parameters.stop must be a bool"):
        kserve_http_codec.parse_generate(b'{"text_input": "a", "parameters": {"stop": ["x"]}}', "tinylm", "")


def test_rest_generate_joins_the_stream_responses_into_one_answer():
    parsed = kserve_stream.parse_stream_request(_stream_request(logprobs=True))
    first = kserve_stream.chunk_responses(parsed, _chunk([(7, -0.25, []), (8, -0.5, [])]))
    last = kserve_stream.chunk_responses(parsed, _chunk([(9, -1.0, [])], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                                        usage=common_pb2.Usage(prompt_tokens=2, completion_tokens=3)))
    documents = [kserve_http_codec.generate_document(r) for r in first + last]
    assert documents[0] == {"model_name": "tinylm", "model_version": "", "id": "s-1", "text_output": "ab",
                            "logprobs": [-0.25, -0.5]}
    joined = kserve_http_codec.joined_documents(documents)
    assert (joined["text_output"], joined["logprobs"], joined["id"]) == ("abab", [-0.25, -0.5, -1.0], "s-1")
    assert joined["parameters"] == {"finish_reason": "length", "prompt_tokens": 2, "completion_tokens": 3,
                                    "cached_prompt_tokens": 0}


# -- token prompts: input_ids in place of text_input ------------------------------------------------


def _token_request(datatype: str, shape: list[int], ids: list[int], raw: bool = True) -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="tinylm", id="t-1")
    tensor = request.inputs.add(name="input_ids", datatype=datatype, shape=shape)
    if raw:
        request.raw_input_contents.append(struct.pack(f"<{len(ids)}{'i' if datatype == 'INT32' else 'q'}", *ids))
    elif datatype == "INT32":
        tensor.contents.int_contents.extend(ids)
    else:
        tensor.contents.int64_contents.extend(ids)
    return request


@pytest.mark.parametrize(("datatype", "shape", "raw"), [
    ("INT32", [3], True), ("INT64", [1, 3], True), ("INT32", [1, 3], False), ("INT64", [3], False),
])
def test_input_ids_go_upstream_as_prompt_token_ids(datatype, shape, raw):
    parsed = kserve_stream.parse_stream_request(_token_request(datatype, shape, [104, 105, 0], raw))
    assert list(parsed.generate.prompt_token_ids) == [104, 105, 0] and not parsed.generate.prompt


@pytest.mark.parametrize(("request_", "fragment"), [
    (_token_request("FP32", [2], [1, 2]), "input 'input_ids' must be INT32 or INT64 token ids, got FP32"),
    (_token_request("INT32", [0], []), "input 'input_ids' must have shape [n] or [1, n] with n >= 1, got [0]"),
    (_token_request("INT64", [2, 2], [1, 2, 3, 4]), "must have shape [n] or [1, n]"),
    (_token_request("INT32", [3], [1, 2]), "input 'input_ids' holds 2 elements, its shape [3] says 3"),
    (_token_request("INT64", [2], [5, -3]), "input 'input_ids'[1] must be a token id (an integer >= 0), got -3"),
    (_token_request("INT64", [1], [2**32], raw=False), "input 'input_ids'[0] must be a token id"),
])
def test_bad_input_ids_are_invalid_argument_naming_the_input(request_, fragment):
    with pytest.raises(InvalidArgument) as refused:
        kserve_stream.parse_stream_request(request_)
    assert fragment in refused.value.message


def test_text_input_and_input_ids_together_are_refused():
    both = _token_request("INT32", [1], [7])
    both.inputs.insert(0, kserve.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[1], contents=kserve.InferTensorContents(bytes_contents=[b"Hi"])))
    both.ClearField("raw_input_contents")
    with pytest.raises(InvalidArgument, match="expected exactly one input: 'text_input' .* or 'input_ids'"):
        kserve_stream.parse_stream_request(both)


def test_the_schedulers_refusal_of_an_id_past_the_vocabulary_names_input_ids():
    parsed = kserve_stream.parse_stream_request(_token_request("INT32", [2], [1, 10**9]))
    refused = InvalidArgument("prompt_token_ids[1] is 1000000000, but the model's token ids are 0..256 (vocab_size 257)")
    assert kserve_stream.named_refusal(parsed, refused).message == (
        "input 'input_ids'[1] is 1000000000, but the model's token ids are 0..256 (vocab_size 257)")


def test_rest_generate_takes_input_ids_in_place_of_text_input():
    request = kserve_http_codec.parse_generate(b'{"input_ids": [104, 105], "parameters": {"max_tokens": 2}}',
                                               "tinylm", "")
    parsed = kserve_stream.parse_stream_request(request)
    assert (list(parsed.generate.prompt_token_ids), parsed.generate.prompt) == ([104, 105], "")
    for body, fragment in [
        (b'{"input_ids": [1], "text_input": "a"}', "send 'text_input' (the prompt's text) or 'input_ids'"),
        (b'{"input_ids": []}', "'input_ids' must be a non-empty list of token ids (integers >= 0), got []"),
        (b'{"input_ids": [1, -2]}', "'input_ids' must be a non-empty list of token ids"),
        (b'{"input_ids": "1 2"}', "'input_ids' must be a non-empty list"),
        (b'{"input_ids": [1.5]}', "'input_ids' must be a non-empty list"),
        (b'{}', "'text_input' must be a string (the prompt), or send 'input_ids' (its token ids)"),
    ]:
        with pytest.raises(InvalidArgument) as refused:
            kserve_http_codec.parse_generate(body, "tinylm", "")
        assert fragment in refused.value.message, body
