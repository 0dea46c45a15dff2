from __future__ import annotations

import pytest

from services.scheduler.prefix_cache import (
    PUBLIC_SALT,
    PrefixCacheKeys,
    block_hashes,
    extend_block_hashes,
    next_block_hash,
    tenant_salt,
)

SALT = tenant_salt("acme")


def test_one_hash_per_full_block_and_none_for_a_partial_block():
    assert len(block_hashes(range(15), 4, SALT)) == 3
    assert len(block_hashes(range(16), 4, SALT)) == 4
    assert block_hashes(range(3), 4, SALT) == []
    assert block_hashes((), 4, SALT) == []


def test_the_same_prefix_gives_the_same_hashes_whatever_follows():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 4, SALT)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44, 45], 4, SALT)
    assert a[:2] == b[:2]
    assert b[2] != block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 4, SALT)[2]


def test_hashes_are_chained_so_an_equal_block_after_a_different_prefix_differs():
    a = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, SALT)
    b = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4, SALT)
    assert a[1] != b[1]
    assert a[1] == next_block_hash(a[0], [9, 9, 9, 9], SALT)


def test_a_different_salt_gives_different_hashes_for_every_block():
    a = block_hashes(range(12), 4, tenant_salt("acme"))
    b = block_hashes(range(12), 4, tenant_salt("globex"))
    assert not set(a) & set(b)


def test_salt_and_tokens_cannot_be_traded_against_each_other():
    # The salt is length-prefixed: a salt that ends like the tokens begin names another block.
    assert next_block_hash(None, [1], b"ab") != next_block_hash(None, [1], b"a")


def test_extending_gives_the_hashes_computing_them_all_at_once_gives():
    tokens = list(range(30))
    hashes = block_hashes(tokens[:9], 4, SALT)
    assert extend_block_hashes(hashes, tokens[8:], 4, SALT) == block_hashes(tokens, 4, SALT)
    assert len(hashes) == 7
    public = block_hashes(tokens[:4], 4, SALT, num_public_tokens=12)
    assert extend_block_hashes(public, tokens[4:], 4, SALT, num_public_tokens=12) == block_hashes(
        tokens, 4, SALT, num_public_tokens=12)


def test_rejects_a_block_size_below_one():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block_hashes([1], 0, SALT)


def test_blocks_inside_a_public_prefix_are_shared_across_tenants_and_later_ones_are_not():
    system = tuple(range(100, 110))  # 10 tokens: blocks 0 and 1 (of 4) lie inside it, block 2 does not
    keys = PrefixCacheKeys.of([system])
    prompt = (*system, 1, 2, 3, 4, 5, 6)
    acme = keys.block_hashes(prompt, 4, "acme")
    globex = keys.block_hashes(prompt, 4, "globex")
    assert acme[:2] == globex[:2]
    assert acme[2:] != globex[2:] and not set(acme[2:]) & set(globex[2:])
    assert acme[:2] == block_hashes(system, 4, PUBLIC_SALT)


def test_a_prompt_that_does_not_start_with_a_public_prefix_is_all_tenant_salted():
    keys = PrefixCacheKeys.of([(7, 7, 7, 7)])
    assert keys.num_public_tokens((7, 7, 7)) == 0
    assert keys.num_public_tokens((1, 7, 7, 7, 7)) == 0
    assert keys.block_hashes((1, 7, 7, 7, 7, 7, 7, 7), 4, "a") != keys.block_hashes((1, 7, 7, 7, 7, 7, 7, 7), 4, "b")


def test_the_longest_matching_public_prefix_counts():
    keys = PrefixCacheKeys.of([(1, 2), (1, 2, 3, 4), (), (9,)])
    assert keys.num_public_tokens((1, 2, 3, 4, 5)) == 4
    assert keys.num_public_tokens((1, 2, 3)) == 2
    assert keys.num_public_tokens((9, 9)) == 1
    assert PrefixCacheKeys().num_public_tokens((1, 2)) == 0
