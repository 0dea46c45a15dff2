"""vLLM's /tokenize and /detokenize bodies (no transport)."""

from __future__ import annotations

import pytest

from infermesh.v1 import gateway_pb2
from services.gateway.fronts import openai_tokenize
from services.gateway.fronts.openai_http import OpenAIFront
from services.gateway.fronts.openai_params import BadParameter


def test_a_prompt_and_its_options():
    request, strs = openai_tokenize.parse_tokenize({"model": "m:3", "prompt": "hi"})
    assert (request.model.name, request.model.version, request.prompt, request.add_special_tokens, strs) == (
        "m", "3", "hi", True, False)
    request, strs = openai_tokenize.parse_tokenize({"model": "m", "prompt": "hi", "add_special_tokens": False,
                                                    "return_token_strs": True})
    assert (request.add_special_tokens, strs) == (False, True)


def test_no_model_is_the_callers_only_generator_as_vllms_single_model():
    request, _ = openai_tokenize.parse_tokenize({"prompt": "test", "add_special_tokens": False})
    assert (request.model.name, request.add_special_tokens) == ("", False)
    assert openai_tokenize.parse_detokenize({"tokens": [1]}).model.name == ""


def test_a_conversation_with_tools():
    tools = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]
    request, _ = openai_tokenize.parse_tokenize({"model": "m", "messages": [{"role": "user", "content": "t?"}],
                                                 "tools": tools, "add_generation_prompt": False})
    assert [(m.role, m.content) for m in request.messages] == [("user", "t?")]
    assert [t.name for t in request.tools] == ["clock"] and request.add_generation_prompt is False
    assert not request.prompt
    opened, _ = openai_tokenize.parse_tokenize({"model": "m", "messages": [{"role": "assistant", "content": "S"}],
                                                "add_generation_prompt": False, "continue_final_message": True,
                                                "chat_template_kwargs": {"x": 1}})
    assert (opened.continue_final_message, opened.chat_template_kwargs) == (True, '{"x": 1}')


@pytest.mark.parametrize(("body", "param", "message"), [
    ([], None, "must be a JSON object"),
    ({"model": 5, "prompt": "a"}, "model", "model must be a model id from GET /v1/models, got 5"),
    ({"model": "m:", "prompt": "a"}, "model", "model must be a model id or <id>:<version>"),
    ({"model": "m"}, "prompt", "send prompt (a string) or messages (a conversation), exactly one"),
    ({"model": "m", "prompt": "a", "messages": []}, "prompt", "exactly one"),
    ({"model": "m", "prompt": ""}, "prompt", "prompt must be a non-empty string"),
    ({"model": "m", "prompt": [1, 2]}, "prompt", "prompt must be a non-empty string"),
    ({"model": "m", "prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "must be a boolean"),
    ({"model": "m", "messages": [{"role": "robot", "content": "a"}]}, "messages[0].role", "role"),
])
def test_bad_tokenize_bodies_name_the_parameter(body, param, message):
    with pytest.raises(BadParameter) as refused:
        openai_tokenize.parse_tokenize(body)
    assert refused.value.param == param and message in str(refused.value)


@pytest.mark.parametrize(("body", "message"), [
    ({"model": "m"}, "tokens must be a list of token ids, got None"),
    ({"model": "m", "tokens": [1, -1]}, "tokens[1] must be a token id (an integer >= 0), got -1"),
    ({"model": "m", "tokens": [True]}, "tokens[0] must be a token id"),
    ({"model": "m", "tokens": [2**32]}, "tokens[0] must be a token id"),
])
def test_bad_detokenize_bodies_name_tokens(body, message):
    with pytest.raises(BadParameter) as refused:
        openai_tokenize.parse_detokenize(body)
    assert refused.value.param == "tokens" and message in str(refused.value)


def test_replies_in_vllms_shape():
    reply = gateway_pb2.TokenizeResponse(token_ids=[7, 8], token_bytes=[b"h", b"\xc3"], max_seq_len=64)
    assert openai_tokenize.tokenize_body(reply, False) == {"count": 2, "max_model_len": 64, "tokens": [7, 8],
                                                           "token_strs": None}
    assert openai_tokenize.tokenize_body(reply, True)["token_strs"] == ["h", "\ufffd"]
    assert openai_tokenize.detokenize_body(gateway_pb2.DetokenizeResponse(text="hé")) == {"prompt": "hé"}
    assert openai_tokenize.parse_detokenize({"model": "m", "tokens": [3, 4]}).token_ids == [3, 4]


def test_tokenizer_info_names_a_model_in_its_query_or_none():
    assert openai_tokenize.parse_tokenizer_info({}).model.name == ""  # the caller's only generator
    assert openai_tokenize.parse_tokenizer_info({"model": "m:3"}).model.version == "3"
    with pytest.raises(BadParameter) as refused:
        openai_tokenize.parse_tokenizer_info({"modle": "m"})
    assert refused.value.param == "modle" and "takes model" in str(refused.value)


def test_tokenizer_info_answers_tokenizer_config_jsons_fields_as_vllm_does():
    reply = gateway_pb2.GetTokenizerInfoResponse(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False,
                                                 special_tokens={"eos_token": "</s>", "bos_token": "<s>"},
                                                 chat_template="{{ messages }}", max_seq_len=2048)
    assert openai_tokenize.tokenizer_info_body(reply) == {
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "model_max_length": 2048,
        "chat_template": "{{ messages }}", "tokenizer_class": "PreTrainedTokenizerFast"}
    # No template: none named (vLLM's answer has chat_template only when the model has one).
    assert openai_tokenize.tokenizer_info_body(gateway_pb2.GetTokenizerInfoResponse(tokenizer_class="ByteTokenizer",
                                                                                    max_seq_len=64)) == {
        "model_max_length": 64, "tokenizer_class": "ByteTokenizer"}


@pytest.mark.parametrize(("flag", "paths"), [
    (False, ["/tokenize", "/detokenize"]), (True, ["/tokenize", "/detokenize", "/tokenizer_info"]),
])
def test_tokenizer_info_is_served_only_behind_its_flag_as_in_vllm(flag, paths):
    front = OpenAIFront(None, None, None, text=object(), tokenizer_info=flag)  # type: ignore[arg-type]
    assert [route.path for route in front.routes() if "token" in route.path] == paths
