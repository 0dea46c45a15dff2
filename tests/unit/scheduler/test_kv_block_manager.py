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


# -- prefix cache ----------------------------------------------------------------


def _cached_sequence(kv: KVBlockManager, seq_id: int, hashes: list[int], num_tokens: int) -> tuple[int, ...]:
    """A sequence whose table covers `num_tokens`, its first len(hashes) blocks computed and registered."""
    kv.allocate(seq_id, num_tokens)
    kv.register_computed(seq_id, hashes)
    return kv.block_table(seq_id)


def test_counts_only_the_leading_resident_hashes():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    _cached_sequence(kv, 1, [11, 12, 13], 14)
    assert kv.num_cached_prefix_blocks([11, 12, 13, 14]) == 3
    assert kv.num_cached_prefix_blocks([11, 99, 13]) == 1
    assert kv.num_cached_prefix_blocks([99, 11]) == 0
    assert kv.num_cached_prefix_blocks([]) == 0
    assert kv.num_cached_blocks == 3


def test_a_new_table_reuses_resident_prefix_blocks_by_reference():
    kv = KVBlockManager(num_blocks=8, block_size=4)
    first = _cached_sequence(kv, 1, [11, 12], 10)
    table = kv.allocate_prefixed(2, [11, 12], 13)
    assert table[:2] == first[:2] and len(table) == 4
    assert table[2:] == (3, 4)
    assert kv.ref_count(first[0]) == 2 and kv.ref_count(first[2]) == 1
    assert kv.num_used_blocks == 5


def test_freed_cached_blocks_stay_findable_until_their_pages_are_needed():
    kv = KVBlockManager(num_blocks=4, block_size=4)
    _cached_sequence(kv, 1, [11, 12], 8)
    kv.free(1)
    assert kv.num_free_blocks == 4 and kv.num_used_blocks == 0
    assert kv.num_cached_prefix_blocks([11, 12]) == 2
    # The two never-used blocks go first; the third page needed evicts a cached one.
    assert kv.allocate(2, 8) == (2, 3)
    assert kv.num_cached_prefix_blocks([11, 12]) == 2 and kv.num_evictions == 0
    kv.allocate(2, 9)
    assert kv.num_evictions == 1
    # A sequence's last block is evicted before its first: the prefix others share survives longest.
    assert kv.num_cached_prefix_blocks([11, 12]) == 1


def test_uncached_freed_blocks_are_taken_before_cached_ones_are_evicted():
    kv = KVBlockManager(num_blocks=3, block_size=2)
    _cached_sequence(kv, 1, [11], 2)
    kv.allocate(2, 4)  # blocks 1, 2, never registered
    kv.free(1)
    kv.free(2)
    assert kv.allocate(3, 4) == (1, 2)
    assert kv.num_cached_prefix_blocks([11]) == 1 and kv.num_evictions == 0


def test_eviction_is_least_recently_freed_first():
    kv = KVBlockManager(num_blocks=2, block_size=2)
    _cached_sequence(kv, 1, [11], 2)
    _cached_sequence(kv, 2, [21], 2)
    kv.free(2)
    kv.free(1)  # freed last: evicted last
    kv.allocate(3, 2)
    assert kv.num_cached_prefix_blocks([21]) == 0
    assert kv.num_cached_prefix_blocks([11]) == 1


def test_reusing_an_evictable_block_takes_it_out_of_the_free_pool():
    kv = KVBlockManager(num_blocks=3, block_size=2)
    _cached_sequence(kv, 1, [11, 12], 4)
    kv.free(1)
    assert kv.can_allocate_prefixed([11, 12], 6)  # 2 reused + 1 new of 3 free
    assert not kv.can_allocate_prefixed([11, 12], 6, reserve_blocks=1)
    assert not kv.can_allocate_prefixed([11], 7)  # 1 reused + 3 new
    kv.allocate_prefixed(2, [11, 12], 6)
    assert kv.num_free_blocks == 0
    with pytest.raises(OutOfBlocksError):
        kv.allocate_prefixed(3, [], 1)


def test_a_shared_block_returns_to_the_pool_only_when_its_last_reference_is_freed():
    kv = KVBlockManager(num_blocks=4, block_size=2)
    shared = _cached_sequence(kv, 1, [11], 2)[0]
    kv.allocate_prefixed(2, [11], 3)
    kv.free(1)
    assert kv.ref_count(shared) == 1 and kv.num_used_blocks == 2
    kv.free(2)
    assert kv.ref_count(shared) == 0 and kv.num_used_blocks == 0
    assert kv.num_cached_prefix_blocks([11]) == 1


def test_a_prefix_computed_twice_at_once_is_registered_once():
    kv = KVBlockManager(num_blocks=2, block_size=2)
    first = _cached_sequence(kv, 1, [11], 2)
    second = _cached_sequence(kv, 2, [11], 2)
    assert kv.num_cached_blocks == 1
    kv.free(1)
    kv.free(2)
    # The second copy went back uncached, so it is reused before the cached one is evicted.
    assert kv.allocate(3, 1) == second
    assert kv.num_cached_prefix_blocks([11]) == 1 and kv.num_evictions == 0
    assert kv.allocate(4, 1) == first and kv.num_cached_prefix_blocks([11]) == 0


def test_registering_is_incremental_and_ignores_unknown_sequences():
    kv = KVBlockManager(num_blocks=8, block_size=2)
    kv.allocate(1, 6)
    kv.register_computed(1, [11])
    kv.register_computed(1, [11, 12, 13, 14])  # only the table's 3 blocks
    kv.register_computed(9, [11])
    assert kv.num_cached_prefix_blocks([11, 12, 13, 14]) == 3


def test_a_prefixed_table_needs_a_sequence_without_one():
    kv = KVBlockManager(num_blocks=4, block_size=2)
    kv.allocate(1, 2)
    with pytest.raises(ValueError, match="sequence 1 already has a block table"):
        kv.allocate_prefixed(1, [], 2)
