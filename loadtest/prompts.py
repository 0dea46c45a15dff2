"""Prompt text with shared prefixes, for prefix-cache tests: the same key always starts the same way.

make_prompt draws words one after another, so the text drawn from a key's own random stream
for n bytes is the start of the text drawn for more: a key's text can be cut to any length
and every cut of one key shares its beginning. One byte is one token for the byte-level demo
models; other tokenizers see about as many tokens as words.
"""

from __future__ import annotations

import zlib

import numpy as np

from loadtest.payloads import make_prompt


class SharedText:
    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._texts: dict[str, str] = {}

    def text(self, key: str, num_bytes: int) -> str:
        """The first `num_bytes` of `key`'s text."""
        if num_bytes <= 0:
            return ""
        cached = self._texts.get(key, "")
        if len(cached) < num_bytes:
            rng = np.random.default_rng([self._seed, 3, zlib.crc32(key.encode())])
            cached = make_prompt(max(num_bytes, 2 * len(cached)), rng)
            self._texts[key] = cached
        return cached[:num_bytes]


def with_prefix(prefix: str, num_bytes: int, rng: np.random.Generator) -> str:
    """`prefix`, then fresh words up to `num_bytes` in all (the prefix is cut if it is longer)."""
    if len(prefix) >= num_bytes:
        return prefix[:num_bytes]
    return prefix + make_prompt(num_bytes - len(prefix), rng)


def block_prompt(shared: SharedText, hash_ids: tuple[int, ...], block_tokens: int, num_bytes: int,
                 rng: np.random.Generator) -> str:
    """Mooncake's layout: one shared block per hash id, in order, then fresh text to the length."""
    prefix = "".join(shared.text(f"block:{h}", block_tokens) for h in hash_ids)
    return with_prefix(prefix, num_bytes, rng)
