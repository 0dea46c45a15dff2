"""The identity of full KV blocks, which makes the scheduler's block tables a prefix cache.

A full block's hash covers its parent block's hash, a salt and the block's token
ids, so two blocks with the same hash hold the KV of the same tokens at the same
positions after the same prefix: a sequence may reuse the other's page instead of
computing it. Only full blocks get a hash; a partly filled last block is never
shared (so no copy-on-write is ever needed: a shared page is never written).

The salt keeps tenants apart: by default each block is salted with its tenant's
id, so no tenant can hit (or time) another tenant's cache. Blocks lying wholly
inside a prefix an operator marked public (a shared system prompt) are salted
with `PUBLIC_SALT` instead and shared across tenants; the blocks after it chain
on the public hash under the tenant's salt.

Hashes are BLAKE2b (128 bits): collision-resistant, so a tenant cannot craft
tokens that name another prefix's block. Pure: no I/O, no grpc.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The parent "hash" of a sequence's first block.
_ROOT = b"\x00" * 16
PUBLIC_SALT = b"public"


def tenant_salt(tenant_id: str) -> bytes:
    """The default salt of a tenant's blocks."""
    return b"tenant:" + tenant_id.encode()


def cache_salt(tenant_id: str, lora_adapter: str = "") -> bytes:
    """A sequence's blocks' salt: its tenant's, and under a LoRA adapter that adapter's too, so two
    adapters (or an adapter and the base model) never share KV: the same tokens make other keys."""
    salt = tenant_salt(tenant_id)
    return salt if not lora_adapter else salt + b"\x00lora:" + lora_adapter.encode()


def next_block_hash(parent: int | None, token_ids: Sequence[int], salt: bytes) -> int:
    """The hash of one full block whose parent block hashed to `parent` (None: the first block)."""
    h = hashlib.blake2b(_ROOT if parent is None else parent.to_bytes(16, "little"), digest_size=16)
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(array.array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, salt: bytes, *,
                        num_public_tokens: int = 0) -> list[int]:
    """Appends to `hashes` (a sequence's first len(hashes) block hashes) the hash of each FULL block
    of `token_ids`, the sequence's tokens from position len(hashes) * block_size on; returns `hashes`.
    Blocks wholly inside the sequence's first `num_public_tokens` tokens are salted with PUBLIC_SALT
    instead of `salt`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    parent = hashes[-1] if hashes else None
    position = len(hashes) * block_size
    for offset in range(0, len(token_ids) - block_size + 1, block_size):
        end = position + offset + block_size
        block_salt = PUBLIC_SALT if end <= num_public_tokens else salt
        parent = next_block_hash(parent, token_ids[offset:offset + block_size], block_salt)
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes, *, num_public_tokens: int = 0) -> list[int]:
    """One hash per FULL block of `token_ids`, each chained on the one before (a partial last
    block has none). Equal results for two sequences mean equal tokens and salts up to there."""
    return extend_block_hashes([], token_ids, block_size, salt, num_public_tokens=num_public_tokens)


@dataclass(frozen=True)
class PrefixCacheKeys:
    """How a sequence's blocks are named: the tenant's salt, except inside a public prefix.

    `public_prefixes`: token ids of the prefixes an operator marked public (e.g. a system prompt
    every tenant sends); a sequence starting with one shares its full blocks with every tenant.
    """

    public_prefixes: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, public_prefixes: Iterable[Sequence[int]]) -> PrefixCacheKeys:
        # Longest first, so the first match is the longest.
        return cls(tuple(sorted((tuple(p) for p in public_prefixes if p), key=len, reverse=True)))

    def num_public_tokens(self, token_ids: Sequence[int]) -> int:
        """Length of the longest public prefix `token_ids` starts with (0: none)."""
        head = tuple(token_ids[:len(self.public_prefixes[0])]) if self.public_prefixes else ()
        for prefix in self.public_prefixes:
            if head[:len(prefix)] == prefix:
                return len(prefix)
        return 0

    def block_hashes(self, token_ids: Sequence[int], block_size: int, tenant_id: str,
                     lora_adapter: str = "") -> list[int]:
        """The hashes the scheduler gives the full blocks of a sequence of `tenant_id` (under
        `lora_adapter`: salted with it, and no public prefix, which the base model's KV fills)."""
        if lora_adapter:
            return block_hashes(token_ids, block_size, cache_salt(tenant_id, lora_adapter))
        return block_hashes(token_ids, block_size, tenant_salt(tenant_id),
                            num_public_tokens=self.num_public_tokens(token_ids))


@dataclass
class PrefixCacheStats:
    """What one worker's prefix cache was asked and gave, since it attached (monotonic counters)."""

    # Full blocks (and their tokens) of admitted sequences that could have been reused.
    num_queried_blocks: int = 0
    num_queried_tokens: int = 0
    # Of those, reused from the cache instead of computed.
    num_hit_blocks: int = 0
    num_hit_tokens: int = 0
