"""A generator's text side: the prompt or the conversation of a GenerateRequest as token ids,
and the byte models' chat template, which must render what the gateway rendered before models
brought their own templates (issue 33)."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common import errors
from services.scheduler.call_codec import prompt_token_ids
from services.scheduler.model_text import build_model_text
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec

from .hf_tokenizer_files import byte_level_json, num_ids
from .test_chat_template import CHATML

BYTE_BOS, BYTE_EOS = 257, 256


def gateway_chat_prompt_before_issue_33(messages: list[dict[str, str]]) -> str:
    """services/gateway/fronts/openai_codec.chat_prompt as it was (commit fae67ec), content already
    joined: the reference the byte template must reproduce byte for byte."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
    [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
     {"role": "user", "content": "again"}],
    # Text a template engine might read as its own: it is data here.
    [{"role": "user", "content": "{{ messages }} {% if x %}y{% endif %} {# c #}"}],
    # Whitespace and newlines kept as they are (trim_blocks/lstrip_blocks touch template text only).
    [{"role": "user", "content": "  lead\n\n  trail  \n"}, {"role": "assistant", "content": "\n"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "Grüße 🙂 가나다 <b>&amp;</b> \\n \t"}],
]


def byte_text(bos_token_id: int = BYTE_BOS, chat_template: str = ""):
    return build_model_text(TokenizerSpec(vocab_size=260, eos_token_id=BYTE_EOS, bos_token_id=bos_token_id,
                                          kind=TokenizerKind.BYTES, chat_template=chat_template))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("bos_token_id", [BYTE_BOS, -1])
def test_byte_models_chat_ids_are_those_of_the_gateways_old_template_as_a_prompt(conversation, bos_token_id):
    text = byte_text(bos_token_id)
    old_prompt = gateway_chat_prompt_before_issue_33(conversation)
    assert text.chat_template is not None
    assert text.chat_template.render(conversation) == old_prompt
    # Before: the gateway sent the rendered text as the prompt, and the scheduler encoded it (BOS included).
    assert text.chat_prompt_ids(conversation) == text.tokenizer.encode(old_prompt)
    assert text.chat_prompt_ids(conversation)[:1] == ((BYTE_BOS,) if bos_token_id >= 0 else (ord(conversation[0]["role"][0]),))


def test_a_byte_model_that_declares_a_template_gets_its_own():
    text = byte_text(chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}>")
    assert text.chat_prompt_ids([{"role": "user", "content": "hi"}]) == (BYTE_BOS, *b"[user]hi>")


def test_an_hf_model_without_a_template_refuses_chat_and_still_takes_prompts():
    tokenizer_json = byte_level_json()
    text = build_model_text(TokenizerSpec(vocab_size=num_ids(tokenizer_json), eos_token_id=0, kind=TokenizerKind.HF),
                            tokenizer_json)
    with pytest.raises(errors.InvalidArgument, match="this model has no chat template, so it cannot answer chat; "
                                                     "send a prompt"):
        text.chat_prompt_ids([{"role": "user", "content": "hi"}])
    assert prompt_token_ids(gateway_pb2.GenerateRequest(prompt="hi"), text) == text.tokenizer.encode("hi")


def test_an_hf_models_chat_is_its_template_encoded_without_added_specials():
    tokenizer_json = byte_level_json()
    specials = (("bos_token", "<|begin_of_text|>"), ("eos_token", "<|end_of_text|>"))
    text = build_model_text(TokenizerSpec(vocab_size=num_ids(tokenizer_json), eos_token_id=0, kind=TokenizerKind.HF,
                                          special_tokens=specials, chat_template=CHATML), tokenizer_json)
    request = gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content="Grüße")])
    assert text.chat_template is not None
    rendered = text.chat_template.render([{"role": "user", "content": "Grüße"}])
    assert prompt_token_ids(request, text) == text.tokenizer.encode(rendered, add_special_tokens=False)


def request(prompt: str = "", messages: tuple[tuple[str, str], ...] = (),
            token_ids: tuple[int, ...] = ()) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(model=common_pb2.ModelRef(name="m"), prompt=prompt, prompt_token_ids=token_ids,
                                       messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in messages])


def test_token_ids_are_the_prompt_as_they_are_with_no_bos_added():
    text = byte_text()
    assert text.tokenizer.encode("hi")[0] == BYTE_BOS  # a text prompt gets the model's BOS
    assert prompt_token_ids(request(token_ids=(104, 105)), text) == (104, 105)
    assert prompt_token_ids(request(token_ids=(BYTE_BOS, 0, BYTE_EOS)), text) == (BYTE_BOS, 0, BYTE_EOS)


@pytest.mark.parametrize(("bad", "message"), [
    (request(), "prompt must not be empty"),
    (request("hi", (("user", "hi"),)), "set prompt or messages, not both"),
    (request("hi", token_ids=(1,)), "set prompt_token_ids or prompt, not both"),
    (request(messages=(("user", "a"),), token_ids=(1,)), "set prompt_token_ids or messages, not both"),
    (request(token_ids=(1, 2, 260, 7, 999)),
     "prompt_token_ids[2] is 260, but the model's token ids are 0..259 (vocab_size 260)"),
    (request(messages=(("user", "a"), ("robot", "b"))),
     "messages[1].role must be one of system, developer, user, assistant, tool, got 'robot'"),
    (request(messages=(("", "a"),)),
     "messages[0].role must be one of system, developer, user, assistant, tool, got ''"),
])
def test_a_request_needs_exactly_one_of_prompt_and_messages_with_known_roles(bad, message):
    with pytest.raises(errors.InvalidArgument) as caught:
        prompt_token_ids(bad, byte_text())
    assert caught.value.message == message
