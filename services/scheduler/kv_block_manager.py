"""Block tables of one worker's paged KV cache.

The scheduler decides which physical block holds which sequence's tokens; the
worker only stores pages. Block `i` of a sequence's table holds the KV of its
tokens `[i * block_size, (i + 1) * block_size)`. Tables only grow, one block at
a time, until the sequence is freed.
"""

from __future__ import annotations

from collections import deque


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
        # Blocks never handed out yet are [_num_untouched_from, num_blocks) and go first; freed blocks
        # queue at the back, so recently used pages are reused last. Nothing is built per block up
        # front: a worker's hello may declare millions of blocks (a list of them took seconds and GBs).
        self._num_untouched_from = 0
        self._free: deque[int] = deque()
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._num_untouched_from + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

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

    def _take_block(self) -> int:
        if self._num_untouched_from < self.num_blocks:
            self._num_untouched_from += 1
            return self._num_untouched_from - 1
        return self._free.popleft()

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        """Whether a sequence now holding `num_tokens` tokens can take one more."""
        return self.can_allocate(seq_id, num_tokens + 1)

    def append_slot(self, seq_id: int, num_tokens: int) -> tuple[int, ...]:
        """Room for token number `num_tokens + 1`; returns the block appended, if one was."""
        return self.allocate(seq_id, num_tokens + 1)

    def free(self, seq_id: int) -> int:
        """Returns every block of `seq_id` to the pool; the number freed (0 if it had none)."""
        table = self._tables.pop(seq_id, [])
        self._free.extend(table)
        return len(table)
