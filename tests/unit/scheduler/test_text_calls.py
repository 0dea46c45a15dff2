"""Tokenize, Detokenize and GetTokenizerInfo at the scheduler: the ids Generate would compute from, text
back, and what the workers declared of the tokenizer."""

from __future__ import annotations

import pytest

from infermesh.v1 import gateway_pb2
from services.common import errors
from services.scheduler.attach_types import ModelKey
from services.scheduler.call_codec import prompt_token_ids, truncated_prompt
from services.scheduler.model_text import BYTE_CHAT_TEMPLATE
from services.scheduler.text_calls import detokenize, tokenize, tokenizer_info
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec

from .test_chat_template import CHATML
from .test_model_text import BYTE_BOS, BYTE_EOS, byte_text

KEY = ModelKey("m", "2")


def test_a_prompt_tokenizes_as_generate_tokenizes_it_with_its_bos_unless_asked_not_to():
    text = byte_text()
    request = gateway_pb2.TokenizeRequest(prompt="hé")
    reply = tokenize(request, KEY, text, 512)
    generate = gateway_pb2.GenerateRequest(prompt="hé")
    assert tuple(reply.token_ids) == prompt_token_ids(generate, text) == (BYTE_BOS, 104, 0xC3, 0xA9)
    assert list(reply.token_bytes) == [b"", b"h", b"\xc3", b"\xa9"]
    assert (reply.model.name, reply.model.version, reply.max_seq_len) == ("m", "2", 512)
    bare = tokenize(gateway_pb2.TokenizeRequest(prompt="hé", add_special_tokens=False), KEY, text, 512)
    assert list(bare.token_ids) == [104, 0xC3, 0xA9]


def test_a_conversation_renders_the_template_with_or_without_the_generation_prompt():
    text = byte_text(chat_template=CHATML)
    messages = [gateway_pb2.ChatMessage(role="user", content="hi")]
    with_prompt = tokenize(gateway_pb2.TokenizeRequest(messages=messages), KEY, text, 512)
    assert tuple(with_prompt.token_ids) == prompt_token_ids(gateway_pb2.GenerateRequest(messages=messages), text)
    without = tokenize(gateway_pb2.TokenizeRequest(messages=messages, add_generation_prompt=False), KEY, text, 512)
    assert len(without.token_ids) < len(with_prompt.token_ids)
    assert tuple(with_prompt.token_ids[:len(without.token_ids)]) == tuple(without.token_ids)


@pytest.mark.parametrize(("request_fields", "message"), [
    ({}, "prompt must not be empty"),
    ({"prompt": "a", "messages": [gateway_pb2.ChatMessage(role="user", content="a")]}, "set prompt or messages"),
    ({"prompt": "a", "tools": [gateway_pb2.Tool(name="f")]}, "tools need messages"),
])
def test_bad_input_is_refused_as_generates(request_fields, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        tokenize(gateway_pb2.TokenizeRequest(**request_fields), KEY, byte_text(), 512)


def test_detokenize_joins_the_tokens_bytes_then_decodes_them():
    text = byte_text()
    reply = detokenize(gateway_pb2.DetokenizeRequest(token_ids=[BYTE_BOS, 104, 0xC3, 0xA9, BYTE_EOS]), KEY,
                       text.tokenizer)
    assert (reply.text, reply.model.version) == ("hé", "2")
    assert detokenize(gateway_pb2.DetokenizeRequest(token_ids=[0xC3]), KEY, text.tokenizer).text == "\ufffd"
    assert detokenize(gateway_pb2.DetokenizeRequest(), KEY, text.tokenizer).text == ""
    with pytest.raises(errors.InvalidArgument, match=r"token_ids\[1\] is 260, but the model's token ids are 0..259"):
        detokenize(gateway_pb2.DetokenizeRequest(token_ids=[1, 260]), KEY, text.tokenizer)


def test_chat_options_render_the_same_ids_for_generate_and_tokenize():
    text = byte_text(chat_template=CHATML)
    messages = [gateway_pb2.ChatMessage(role="user", content="hi"), gateway_pb2.ChatMessage(role="assistant", content="Su")]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    opened = tokenize(gateway_pb2.TokenizeRequest(messages=messages, **options), KEY, text, 512)
    assert tuple(opened.token_ids) == prompt_token_ids(gateway_pb2.GenerateRequest(messages=messages, **options), text)
    assert bytes(opened.token_ids[-2:]) == b"Su"  # the assistant's turn left open, its end not written
    closed = tokenize(gateway_pb2.TokenizeRequest(messages=messages, add_generation_prompt=False), KEY, text, 512)
    assert tuple(closed.token_ids[:len(opened.token_ids)]) == tuple(opened.token_ids)
    assert len(closed.token_ids) > len(opened.token_ids)


@pytest.mark.parametrize(("fields", "message"), [
    ({"continue_final_message": True}, "cannot be combined with add_generation_prompt true"),
    ({"chat_template_kwargs": "[1]"}, "chat_template_kwargs must be a JSON object, got list"),
    ({"chat_template_kwargs": "{"}, "chat_template_kwargs must be a JSON object: "),
    ({"chat_template_kwargs": '{"tools": []}'}, r"chat_template_kwargs.tools: set by the request itself"),
    ({"chat_template_kwargs": '{"a": "' + "x" * 70_000 + '"}'}, "at most 65536 are allowed"),
])
def test_bad_chat_options_are_invalid_argument(fields, message):
    messages = [gateway_pb2.ChatMessage(role="user", content="hi")]
    with pytest.raises(errors.InvalidArgument, match=message):
        prompt_token_ids(gateway_pb2.GenerateRequest(messages=messages, **fields), byte_text(chat_template=CHATML))


@pytest.mark.parametrize("fields", [{"add_generation_prompt": False}, {"chat_template_kwargs": "{}"}])
def test_chat_options_with_a_prompt_are_refused_rather_than_ignored(fields):
    for request in (gateway_pb2.GenerateRequest(prompt="hi", **fields),
                    gateway_pb2.GenerateRequest(prompt_token_ids=[104], **fields)):
        with pytest.raises(errors.InvalidArgument, match="send them with messages, not a prompt"):
            prompt_token_ids(request, byte_text())
    with pytest.raises(errors.InvalidArgument, match="send them with messages"):
        tokenize(gateway_pb2.TokenizeRequest(prompt="hi", **fields), KEY, byte_text(), 512)


def test_add_special_tokens_and_truncation_shape_the_prompt_ids():
    text = byte_text()
    bare = prompt_token_ids(gateway_pb2.GenerateRequest(prompt="hé", add_special_tokens=False), text)
    assert bare == (104, 0xC3, 0xA9)
    chat = byte_text(chat_template=CHATML)
    messages = [gateway_pb2.ChatMessage(role="user", content="hi")]
    default = prompt_token_ids(gateway_pb2.GenerateRequest(messages=messages), chat)
    without = prompt_token_ids(gateway_pb2.GenerateRequest(messages=messages, add_special_tokens=False), chat)
    assert default == (BYTE_BOS, *without)  # a byte model's chat gets the BOS its template cannot write
    request = gateway_pb2.GenerateRequest(prompt="abcdef", truncate_prompt_tokens=3)
    assert truncated_prompt(prompt_token_ids(request, text), request, 512) == tuple(b"def")
    whole = gateway_pb2.GenerateRequest(prompt="abcdef", truncate_prompt_tokens=-1)
    assert truncated_prompt((1, 2, 3), whole, 2) == (2, 3)
    for keep in (0, -2, 513):
        with pytest.raises(errors.InvalidArgument, match=r"truncate_prompt_tokens must be -1 .* or in \[1, 512\]"):
            truncated_prompt((1,), gateway_pb2.GenerateRequest(prompt="a", truncate_prompt_tokens=keep), 512)


def test_tokenizer_info_is_what_the_workers_declared_of_tokenizer_config_json():
    spec = TokenizerSpec(vocab_size=300, kind=TokenizerKind.HF, add_bos_token=True, chat_template=CHATML,
                         special_tokens=(("bos_token", "<s>"), ("eos_token", "</s>")))
    reply = tokenizer_info(KEY, spec, 2048)
    assert (reply.model.name, reply.model.version, reply.tokenizer_class, reply.max_seq_len) == (
        "m", "2", "PreTrainedTokenizerFast", 2048)
    assert dict(reply.special_tokens) == {"bos_token": "<s>", "eos_token": "</s>"} and reply.chat_template == CHATML
    assert reply.add_bos_token is True and not reply.HasField("add_eos_token")  # the file does not say


def test_a_byte_model_reports_the_plain_template_its_chat_renders_and_an_hf_model_without_one_none():
    byte_model = tokenizer_info(KEY, TokenizerSpec(vocab_size=257), 512)
    assert (byte_model.tokenizer_class, byte_model.chat_template) == ("ByteTokenizer", BYTE_CHAT_TEMPLATE)
    assert tokenizer_info(KEY, TokenizerSpec(kind=TokenizerKind.HF), 512).chat_template == ""
