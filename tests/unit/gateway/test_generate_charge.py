"""What a finished generation charges the tenant's token quota."""

from __future__ import annotations

from infermesh.v1 import common_pb2
from services.gateway.calls.generate_core import tokens_charged


def test_prompt_tokens_the_prefix_cache_held_are_not_charged():
    assert tokens_charged(common_pb2.Usage(prompt_tokens=500, completion_tokens=20)) == 520
    assert tokens_charged(common_pb2.Usage(prompt_tokens=500, cached_prompt_tokens=480, completion_tokens=20)) == 40


def test_a_cached_count_above_the_prompt_charges_no_negative_prompt():
    assert tokens_charged(common_pb2.Usage(prompt_tokens=3, cached_prompt_tokens=9, completion_tokens=2)) == 2
