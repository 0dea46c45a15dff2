"""/v1/embeddings' body as vLLM's EmbeddingCompletionRequest and EmbeddingChatRequest define it: `messages`
in place of `input` (one conversation, add_generation_prompt false unless asked), truncate_prompt_tokens
and add_special_tokens on every input; every refusal names its parameter, the scheduler's too."""

from __future__ import annotations

import json

import pytest

from services.common import errors
from services.gateway.fronts.openai_embeddings import parse_embeddings, upstream_refusal
from services.gateway.fronts.openai_params import BadParameter

MESSAGES = [{"role": "system", "content": "Represent this for retrieval"}, {"role": "user", "content": "a query"}]


def test_messages_become_one_conversation_rendered_without_the_generation_prompt():
    parsed = parse_embeddings({"model": "emb", "messages": MESSAGES, "dimensions": 8})
    (request,) = parsed.requests
    assert [(m.role, m.content) for m in request.messages] == [("system", "Represent this for retrieval"),
                                                               ("user", "a query")]
    assert request.HasField("embed") and request.embed.dimensions == 8 and not request.prompt
    assert request.HasField("add_generation_prompt") and not request.add_generation_prompt  # vLLM's default here
    assert not request.HasField("add_special_tokens")  # the template writes its own
    assert parsed.prompt_param == "messages"


def test_chat_options_pass_through_as_the_chat_front_sends_them():
    (request,) = parse_embeddings({"model": "emb", "messages": MESSAGES, "add_generation_prompt": True,
                                   "chat_template_kwargs": {"enable_thinking": False}}).requests
    assert not request.HasField("add_generation_prompt")  # unset on the wire: true
    assert json.loads(request.chat_template_kwargs) == {"enable_thinking": False}
    (request,) = parse_embeddings({"model": "emb", "messages": MESSAGES, "continue_final_message": True}).requests
    assert request.continue_final_message and not request.add_generation_prompt


def test_truncate_prompt_tokens_and_add_special_tokens_go_on_every_input():
    parsed = parse_embeddings({"model": "emb", "input": ["a", "b"], "truncate_prompt_tokens": 4,
                               "add_special_tokens": False})
    assert [(r.truncate_prompt_tokens, r.add_special_tokens) for r in parsed.requests] == [(4, False), (4, False)]
    (request,) = parse_embeddings({"model": "emb", "messages": MESSAGES, "truncate_prompt_tokens": -1}).requests
    assert request.truncate_prompt_tokens == -1
    (request,) = parse_embeddings({"model": "emb", "input": "a"}).requests
    assert not request.HasField("truncate_prompt_tokens") and not request.HasField("add_special_tokens")


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "a", "messages": MESSAGES}, "messages", "send input or messages, not both"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role", "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content", "images and audio are not supported"),
    ({"input": "a", "add_generation_prompt": True}, "add_generation_prompt", "applies to messages, not input"),
    ({"input": "a", "continue_final_message": True}, "continue_final_message", "applies to messages"),
    ({"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message", "cannot be combined with add_generation_prompt true"),
    ({"messages": MESSAGES, "chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
    ({"messages": MESSAGES, "chat_template": "{{ x }}"}, "chat_template", "chat_template is not supported"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1 (the model's context) or an"),
    ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "got -2"),
    ({"input": "a", "truncate_prompt_tokens": "8"}, "truncate_prompt_tokens", "got '8'"),
    ({"input": "a", "add_special_tokens": "no"}, "add_special_tokens", "add_special_tokens"),
])
def test_bad_bodies_name_the_parameter(body, param, says):
    with pytest.raises(BadParameter) as caught:
        parse_embeddings({"model": "emb", **body})
    assert caught.value.param == param and says in caught.value.message


def test_the_schedulers_refusals_name_what_the_body_sent():
    past = errors.InvalidArgument("truncate_prompt_tokens must be -1 (the model's context) or in [1, 256] (the "
                                  "model's context), got 300")
    assert upstream_refusal(past, 0, 1).param == "truncate_prompt_tokens"
    too_long = errors.InvalidArgument("prompt of 300 tokens is longer than the model's context of 256 tokens")
    refused = upstream_refusal(too_long, 0, 1, "messages")
    assert (refused.param, refused.message) == ("messages", "messages of 300 tokens is longer than the model's "
                                                            "context of 256 tokens")
    no_template = errors.InvalidArgument("this model has no chat template, so it cannot answer chat")
    assert upstream_refusal(no_template, 0, 1, "messages").param == "messages"
    assert upstream_refusal(no_template, 0, 1) is no_template
    assert upstream_refusal(errors.InvalidArgument("chat_template_kwargs.messages: set by the request itself"), 0, 1,
                            "messages").param == "chat_template_kwargs"


@pytest.mark.parametrize("dimensions", [2**32, 2**64, 10**30])
def test_dimensions_past_uint32_are_refused_naming_the_field_not_a_500(dimensions):
    """EmbedOptions.dimensions is a uint32: a larger value once raised ValueError out of the parse (a 500)."""
    with pytest.raises(BadParameter) as caught:
        parse_embeddings({"model": "m", "input": "a", "dimensions": dimensions})
    assert caught.value.param == "dimensions"
