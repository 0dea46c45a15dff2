"""What a finished generation charges the tenant's token quota."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.common.protocol import DEFAULT_MAX_TOKENS
from services.gateway.calls.generate_core import (
    CHAT_TOKENS_PER_CONVERSATION,
    CHAT_TOKENS_PER_MESSAGE,
    prompt_tokens_upper_bound,
    quota_hold,
    tokens_charged,
)
from tests.unit.scheduler.hf_tokenizer_files import TEXT, UNSEEN
from tests.unit.scheduler.test_hf_tokenizer import sentencepiece


def test_prompt_tokens_the_prefix_cache_held_are_not_charged():
    assert tokens_charged(common_pb2.Usage(prompt_tokens=500, completion_tokens=20)) == 520
    assert tokens_charged(common_pb2.Usage(prompt_tokens=500, cached_prompt_tokens=480, completion_tokens=20)) == 40


def test_a_cached_count_above_the_prompt_charges_no_negative_prompt():
    assert tokens_charged(common_pb2.Usage(prompt_tokens=3, cached_prompt_tokens=9, completion_tokens=2)) == 2


@pytest.mark.parametrize("prompt", ["a", " leading space", "Grüße 🙂", TEXT, UNSEEN, "x" * 300, "\n\n  \t"])
def test_the_prompt_hold_bounds_a_sentencepiece_tokenizer_with_bos_and_leading_space(prompt):
    assert len(sentencepiece().encode(prompt)) <= prompt_tokens_upper_bound(prompt)


def test_bytes_plus_one_was_short_for_sentencepiece():
    # BOS, the '▁' SentencePiece puts before the text, then one byte-fallback token per byte of
    # a character its vocabulary lacks.
    assert len(sentencepiece().encode("ŋ")) == len("ŋ".encode()) + 2 == prompt_tokens_upper_bound("ŋ")


def _chat(*contents: str, max_tokens: int = 0) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(messages=[gateway_pb2.ChatMessage(role="user", content=c) for c in contents],
                                       sampling=common_pb2.SamplingParams(max_tokens=max_tokens))


def test_a_conversation_is_held_at_its_bytes_plus_the_templates_allowance():
    prompt, total = quota_hold(_chat("héllo", "x", max_tokens=10), context_len=0)
    expected = len("userhéllo".encode()) + len("userx") + 2 * CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_CONVERSATION
    assert (prompt, total) == (expected, expected + 10)


def test_a_conversations_calls_results_and_tools_are_held_too():
    request = _chat("hi")
    request.messages.add(role="assistant", tool_calls=[gateway_pb2.ToolCall(id="c1", name="f", arguments='{"a": "é"}')])
    request.messages.add(role="tool", content="ok", tool_call_id="c1")
    request.tools.add(name="f", description="does", parameters='{"type": "object"}')
    prompt, _ = quota_hold(request, context_len=0)
    num_bytes = (len("userhi") + len("assistant") + len('f{"a": "é"}'.encode()) + len("toolokc1")
                 + len('fdoes{"type": "object"}'))
    assert prompt == num_bytes + 3 * CHAT_TOKENS_PER_MESSAGE + CHAT_TOKENS_PER_CONVERSATION


def test_the_hold_never_exceeds_the_models_context():
    long_prompt = gateway_pb2.GenerateRequest(prompt="a" * 100_000)
    assert quota_hold(long_prompt, context_len=512) == (512, 512)
    assert quota_hold(long_prompt, context_len=0) == (100_002, 100_002 + DEFAULT_MAX_TOKENS)
    short = gateway_pb2.GenerateRequest(prompt="abc", sampling=common_pb2.SamplingParams(max_tokens=20))
    assert quota_hold(short, context_len=512) == (5, 25)


def test_a_token_prompt_is_held_at_its_count_exactly():
    request = gateway_pb2.GenerateRequest(prompt_token_ids=[5] * 40, sampling=common_pb2.SamplingParams(max_tokens=8))
    assert quota_hold(request, context_len=0) == (40, 48)
    assert quota_hold(request, context_len=44) == (40, 44)


def test_a_truncated_prompt_is_held_at_what_the_scheduler_keeps():
    long_prompt = gateway_pb2.GenerateRequest(prompt="x" * 1000, truncate_prompt_tokens=100,
                                              sampling=common_pb2.SamplingParams(max_tokens=20))
    assert quota_hold(long_prompt, context_len=0) == (100, 120)
    whole = gateway_pb2.GenerateRequest(prompt="x" * 1000, truncate_prompt_tokens=-1,
                                        sampling=common_pb2.SamplingParams(max_tokens=20))
    assert quota_hold(whole, context_len=512) == (512, 512)  # the context caps it, as for any prompt


def test_an_embedding_is_held_and_charged_for_its_prompt_only():
    request = gateway_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7], embed=gateway_pb2.EmbedOptions())
    assert quota_hold(request, context_len=512) == (3, 3)
    assert tokens_charged(common_pb2.Usage(prompt_tokens=3)) == 3
