"""What a Generate stream names of the model's reasoning on its first chunk: the manifest's parser,
none when the prompt ends with a closed think block (thinking turned off), and whether the prompt
ends inside an open one (the output begins as reasoning), read from the prompt's last tokens."""

from __future__ import annotations

import pytest

from services.common.reasoning_formats import DEEPSEEK_R1, QWEN3
from services.scheduler.model_text import ChatRendering, ReasoningStart, build_model_text
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec
from tests.support import reasoning_templates

from .hf_tokenizer_files import byte_level_json, num_ids

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


def model_text(reasoning_parser: str):
    return build_model_text(TokenizerSpec(vocab_size=num_ids(byte_level_json()), eos_token_id=4, bos_token_id=-1,
                                          kind=TokenizerKind.HF, special_tokens=tuple(sorted(SPECIAL.items())),
                                          chat_template=reasoning_templates.QWEN3, reasoning_parser=reasoning_parser),
                            byte_level_json())


@pytest.mark.parametrize(("variables", "expected"), [
    ({}, ReasoningStart(QWEN3, opened=False)),  # the model opens its own block, or answers
    ({"thinking_in_prompt": True}, ReasoningStart(QWEN3, opened=True)),
    ({"enable_thinking": False}, ReasoningStart()),  # an empty, closed block: nothing to split
])
def test_the_prompts_last_think_tag_says_where_the_output_begins(variables, expected):
    text = model_text(QWEN3)
    prompt = text.chat_prompt_ids(MESSAGES, rendering=ChatRendering(variables=variables))
    assert text.reasoning_start(prompt) == expected


def test_a_think_tag_earlier_in_the_prompt_says_nothing_about_this_turn():
    text = model_text(DEEPSEEK_R1)
    prompt = text.tokenizer.encode("<think>\nold\n</think>\n\n" + "A long answer that followed it. " * 4)
    assert text.reasoning_start(prompt) == ReasoningStart(DEEPSEEK_R1, opened=False)


def test_a_model_without_a_reasoning_parser_names_none_whatever_the_prompt():
    text = model_text("")
    assert text.reasoning_start(text.tokenizer.encode("<think>\n")) == ReasoningStart()
