"""What a Generate stream names of the model's reasoning on its first chunk: the manifest's parser,
none when the prompt ends with a closed think block (thinking turned off), and whether the prompt
ends inside an open one (the output begins as reasoning), read from the prompt's last tokens; and,
for a constrained output, where its grammar starts (after `</think>`, as vLLM constrains a reasoning
model, only where the think tags are single tokens)."""

from __future__ import annotations

import pytest

from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.common.reasoning_formats import DEEPSEEK_R1, QWEN3
from services.scheduler.model_text import ChatRendering, ReasoningStart, build_model_text
from services.scheduler.tokenizer_spec import TokenizerKind, TokenizerSpec
from tests.support import reasoning_templates

from .hf_tokenizer_files import byte_level_json, num_ids, with_added_tokens

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


# The byte-level BPE with the think tags as single tokens, as Qwen3's and the R1 distills' tokenizers have them.
THINK_TAGS = ("<think>", "</think>")
THINK_START, THINK_END = num_ids(byte_level_json()), num_ids(byte_level_json()) + 1


def model_text(reasoning_parser: str, tokenizer_json: bytes | None = None):
    tokenizer_json = byte_level_json() if tokenizer_json is None else tokenizer_json
    return build_model_text(TokenizerSpec(vocab_size=num_ids(tokenizer_json), eos_token_id=4, bos_token_id=-1,
                                          kind=TokenizerKind.HF, special_tokens=tuple(sorted(SPECIAL.items())),
                                          chat_template=reasoning_templates.QWEN3, reasoning_parser=reasoning_parser),
                            tokenizer_json)


def grammar_after(text, variables: dict) -> GrammarAfterReasoning | None:
    prompt = text.chat_prompt_ids(MESSAGES, rendering=ChatRendering(variables=variables))
    return text.reasoning_start(prompt, constrained=True).grammar_after


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


@pytest.mark.parametrize(("parser", "variables", "expected"), [
    # qwen3: the model may open its own block, at its first token, or answer at once.
    (QWEN3, {}, GrammarAfterReasoning(THINK_END, start_token_id=THINK_START)),
    (QWEN3, {"thinking_in_prompt": True}, GrammarAfterReasoning(THINK_END)),  # the prompt opened it
    (DEEPSEEK_R1, {}, GrammarAfterReasoning(THINK_END)),  # reasoning until </think>, <think> written or not
    (DEEPSEEK_R1, {"thinking_in_prompt": True}, GrammarAfterReasoning(THINK_END)),
    (QWEN3, {"enable_thinking": False}, None),  # thinking off: the grammar holds the output, as before
    (DEEPSEEK_R1, {"enable_thinking": False}, None),
])
def test_a_grammar_waits_for_the_think_block_wherever_the_output_may_begin_as_reasoning(parser, variables, expected):
    text = model_text(parser, with_added_tokens(byte_level_json(), THINK_TAGS))
    assert (text.think_start_token_id, text.think_end_token_id) == (THINK_START, THINK_END)
    assert grammar_after(text, variables) == expected


@pytest.mark.parametrize("variables", [{}, {"thinking_in_prompt": True}, {"enable_thinking": False}])
@pytest.mark.parametrize("parser", [QWEN3, DEEPSEEK_R1])
def test_a_grammar_holds_the_whole_output_where_the_tokenizer_writes_the_end_tag_in_pieces(parser, variables):
    for tokenizer_json in (byte_level_json(),  # plain byte-level BPE: "</think>" is several tokens
                           with_added_tokens(byte_level_json(), THINK_TAGS, special=True)):  # tags without text
        text = model_text(parser, tokenizer_json)
        assert text.think_end_token_id is None
        assert grammar_after(text, variables) is None


def test_qwen3_waits_on_an_unopened_prompt_only_where_the_opening_tag_is_one_token_too():
    text = model_text(QWEN3, with_added_tokens(byte_level_json(), ("</think>",)))
    end = num_ids(byte_level_json())
    assert text.think_start_token_id is None and text.think_end_token_id == end
    assert grammar_after(text, {}) is None  # the model could not open a block the worker can tell
    assert grammar_after(text, {"thinking_in_prompt": True}) == GrammarAfterReasoning(end)


def test_an_output_without_a_grammar_names_no_grammar_start():
    text = model_text(DEEPSEEK_R1, with_added_tokens(byte_level_json(), THINK_TAGS))
    prompt = text.chat_prompt_ids(MESSAGES)
    assert text.reasoning_start(prompt) == ReasoningStart(DEEPSEEK_R1, opened=False)
    assert text.reasoning_start(prompt, constrained=True).grammar_after == GrammarAfterReasoning(THINK_END)
