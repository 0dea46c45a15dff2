"""Block tables of one worker's paged KV cache, and which of its pages hold cached prefixes.

The scheduler decides which physical block holds which sequence's tokens; the
worker only stores pages. Block `i` of a sequence's table holds the KV of its
tokens `[i * block_size, (i + 1) * block_size)`. Tables only grow, one block at
a time, until the sequence is freed.

Prefix cache: a full block whose KV was computed may be registered under its
hash (prefix_cache.py). A new sequence's table may then start with resident
blocks of its prefix (`allocate_prefixed`), shared with other sequences by
reference count. A block nobody references goes back to the free pool but keeps
its hash, so a later sequence can still reuse it, until its page is needed:
blocks never used go first, then freed uncached ones, then the least recently
freed cached one is evicted. Only full blocks are shared and a shared page is
never written (a sequence writes only past its reused prefix), so no
copy-on-write is needed.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfBlocksError(RuntimeError):
    """allocate() was asked for more blocks than are free; call can_allocate() first."""


class KVBlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Every block is in exactly one place: never handed out ([_num_untouched_from, num_blocks)),
        # referenced by tables (_refs), free and uncached (_free), or free but still cached
        # (_evictable, least recently freed first). Nothing is built per block up front: a worker's
        # hello may declare millions of blocks (a list of them took seconds and GBs); each structure
        # holds only blocks that were handed out, and every operation on it is O(1).
        self._num_untouched_from = 0
        self._free: deque[int] = deque()
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs: dict[int, int] = {}
        self._tables: dict[int, list[int]] = {}
        # The cache index: hash <-> resident block (referenced or evictable).
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        # Per sequence, how many leading blocks of its table are registered (or were reused).
        self._num_registered: dict[int, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no table references (cached ones included: they are evicted when needed)."""
        return self.num_blocks - len(self._refs)

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a registered prefix, referenced or not."""
        return len(self._block_of_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._tables.get(seq_id, ()))

    def ref_count(self, block: int) -> int:
        return self._refs.get(block, 0)

    def num_missing_blocks(self, seq_id: int, num_tokens: int) -> int:
        """Blocks `seq_id` still needs so its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def _covers(self, seq_id: int, num_tokens: int) -> bool:
        """Whether the table already covers `num_tokens` (most decode steps): no block arithmetic."""
        table = self._tables.get(seq_id)
        return table is not None and num_tokens >= 0 and len(table) * self.block_size >= num_tokens

    def can_allocate(self, seq_id: int, num_tokens: int, *, reserve_blocks: int = 0) -> bool:
        """Whether the table of `seq_id` can grow to cover `num_tokens` tokens in total,
        leaving at least `reserve_blocks` free."""
        num_free = self.num_free_blocks
        if reserve_blocks <= num_free and self._covers(seq_id, num_tokens):
            return True
        return self.num_missing_blocks(seq_id, num_tokens) + reserve_blocks <= num_free

    def allocate(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """Grows the table of `seq_id` to cover `num_tokens` tokens; returns the appended block ids."""
        if self._covers(seq_id, num_tokens):
            return ()
        missing = self.num_missing_blocks(seq_id, num_tokens)
        if missing > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id} needs {missing} more blocks for {num_tokens} tokens, {self.num_free_blocks} free"
            )
        new_blocks = tuple(self._take_block() for _ in range(missing))
        self._tables.setdefault(seq_id, []).extend(new_blocks)
        return new_blocks

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether a sequence now holding `num_tokens` tokens can take one more."""
        return self.can_allocate(seq_id, num_tokens + 1)

    def append_slot(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """Room for token number `num_tokens + 1`; returns the block appended, if one was."""
        return self.allocate(seq_id, num_tokens + 1)

    def free(self, seq_id: int) -> int:
        """Drops the table of `seq_id`; its blocks nobody else references return to the pool, cached
        ones still findable. Returns the table's length (0 if it had none)."""
        table = self._tables.pop(seq_id, [])
        self._num_registered.pop(seq_id, None)
        refs = self._refs
        unreferenced = []
        for block in table:
            count = refs[block] - 1
            if count:
                refs[block] = count
            else:
                del refs[block]
                unreferenced.append(block)
        self._free.extend(b for b in unreferenced if b not in self._hash_of_block)
        # Reversed: a sequence's last blocks are evicted before its first ones, which more sequences share.
        self._evictable.update((b, None) for b in reversed(unreferenced) if b in self._hash_of_block)
        return len(table)

    # -- prefix cache ----------------------------------------------------------

    def num_cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading `hashes` name a resident block (referenced or evictable)."""
        cached = self._block_of_hash
        for count, block_hash in enumerate(hashes):
            if block_hash not in cached:
                return count
        return len(hashes)

    def can_allocate_prefixed(self, prefix_hashes: Sequence[int], num_tokens: int, *,
                              reserve_blocks: int = 0) -> bool:
        """Whether a new table that starts with the resident blocks of `prefix_hashes` can cover
        `num_tokens` tokens, leaving `reserve_blocks` free (reusing an evictable block takes it
        out of the free pool too)."""
        num_reused_free = sum(1 for h in prefix_hashes if self._block_of_hash[h] not in self._refs)
        num_new = max(0, self.blocks_for(num_tokens) - len(prefix_hashes))
        return num_new + num_reused_free + reserve_blocks <= self.num_free_blocks

    def allocate_prefixed(self, seq_id: int, prefix_hashes: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """Starts the table of `seq_id` (it must have none) with the resident blocks of
        `prefix_hashes` (from num_cached_prefix_blocks), then grows it to cover `num_tokens`;
        returns the whole table."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        if not self.can_allocate_prefixed(prefix_hashes, num_tokens):
            raise OutOfBlocksError(
                f"sequence {seq_id} needs more blocks for {num_tokens} tokens than the {self.num_free_blocks} free"
            )
        table = [self._block_of_hash[h] for h in prefix_hashes]
        for block in table:
            self._evictable.pop(block, None)
            self._refs[block] = self._refs.get(block, 0) + 1
        self._tables[seq_id] = table
        self._num_registered[seq_id] = len(table)
        self.allocate(seq_id, num_tokens)
        return tuple(table)

    def register_computed(self, seq_id: int, hashes: Sequence[int]) -> None:
        """The KV of the first len(hashes) blocks of `seq_id` is computed: each becomes findable under
        its hash, unless another block already holds that hash (two sequences computed the same
        prefix at once; this one's copy stays private and is freed uncached)."""
        table = self._tables.get(seq_id)
        if table is None:
            return
        start = self._num_registered.get(seq_id, 0)
        end = min(len(hashes), len(table))
        for index in range(start, end):
            block, block_hash = table[index], hashes[index]
            if block_hash not in self._block_of_hash and block not in self._hash_of_block:
                self._block_of_hash[block_hash] = block
                self._hash_of_block[block] = block_hash
        if end > start:
            self._num_registered[seq_id] = end

    # -- internals ---------------------------------------------------------------

    def _take_block(self) -> int:
        """A free block, referenced once: never used, else freed uncached, else the least recently
        freed cached one (evicted from the cache)."""
        if self._num_untouched_from < self.num_blocks:
            block = self._num_untouched_from
            self._num_untouched_from += 1
        elif self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block)]
            self.num_evictions += 1
        self._refs[block] = 1
        return block
