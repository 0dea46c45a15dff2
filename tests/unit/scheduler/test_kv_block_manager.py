from __future__ import annotations

import pytest

from services.scheduler.kv_block_manager import KVBlockManager, OutOfBlocksError


def test_allocate_covers_the_tokens_and_returns_only_the_appended_blocks():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    assert kv.allocate(1, 6) == (0, 1)
    assert kv.allocate(1, 8) == ()  # still fits in two blocks
    assert kv.allocate(1, 9) == (2,)
    assert kv.block_table(1) == (0, 1, 2)
    assert kv.num_free_blocks == 5


def test_append_slot_takes_a_block_only_at_a_block_boundary():
    kv = KVBlockManager(num_blocks=4, block_size=4)
    kv.allocate(7, 3)
    assert kv.can_append(7, 3)
    assert kv.append_slot(7, 3) == ()
    assert kv.append_slot(7, 4) == (1,)


def test_cannot_allocate_more_than_is_free_and_allocate_says_why():
    kv = KVBlockManager(num_blocks=2, block_size=4)
    kv.allocate(1, 4)
    assert kv.can_allocate(2, 4)
    assert not kv.can_allocate(2, 5)
    assert not kv.can_allocate(2, 4, reserve_blocks=1)
    with pytest.raises(OutOfBlocksError, match="sequence 2 needs 2 more blocks for 5 tokens, 1 free"):
        kv.allocate(2, 5)
    assert kv.block_table(2) == ()


def test_free_returns_blocks_to_the_pool_and_usage_follows():
    kv = KVBlockManager(num_blocks=4, block_size=2)
    kv.allocate(1, 4)
    kv.allocate(2, 2)
    assert kv.usage == pytest.approx(0.75)
    assert kv.free(1) == 2
    assert kv.free(1) == 0
    assert 1 not in kv and 2 in kv
    assert kv.num_used_blocks == 1
    # Freed blocks are reused last, after the never-used one.
    assert kv.allocate(3, 2) == (3,)


def test_rejects_bad_arguments_with_precise_messages():
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        KVBlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVBlockManager(4, 0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        KVBlockManager(4, 4).can_allocate(1, -1)


def test_a_pool_as_large_as_a_hello_can_declare_is_built_without_a_list_of_its_blocks():
    # Found by atheris (fuzz/attach_hello.py): a generator's hello declaring 68 million KV blocks made
    # the scheduler build a deque of every block id on Attach (14 s and ~1 GB; 2**32 - 1 would exhaust memory).
    kv = KVBlockManager(2**32 - 1, 16)
    assert kv.num_free_blocks == 2**32 - 1
    assert kv.allocate(seq_id=1, num_tokens=33) == (0, 1, 2)
    assert kv.num_free_blocks == 2**32 - 4 and kv.num_used_blocks == 3


def test_untouched_blocks_go_before_freed_ones_and_freed_ones_oldest_first():
    kv = KVBlockManager(num_blocks=4, block_size=1)
    assert kv.allocate(seq_id=1, num_tokens=1) == (0,)
    assert kv.allocate(seq_id=2, num_tokens=1) == (1,)
    kv.free(2)
    kv.free(1)
    assert kv.allocate(seq_id=3, num_tokens=4) == (2, 3, 1, 0)
    assert kv.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        kv.allocate(seq_id=4, num_tokens=1)
