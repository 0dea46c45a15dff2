"""Constrained sampling: the tokens a sequence's grammar allows next (llguidance).

The scheduler compiles a request's structured output into a grammar (scheduler/structured_output.py)
and sends it with each step; the worker keeps one matcher per sequence, made from the grammar on
the sequence's first sample here and fed the sequence's output tokens (the last num_generated of
its tokens) before each sample. So a table reset, a recompute or a continuation on another worker
rebuilds the same matcher from the same tokens: constrained sampling stays a function of the
tokens, the seed and the position. Once the grammar is complete only end-of-sequence ids are
allowed, so the sequence ends there.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np


class GrammarError(ValueError):
    """The grammar does not load, or the output left it (the sequence fails alone)."""


class GrammarTokenizer:
    """The model's tokenizer as llguidance needs it: every id's bytes and the end-of-sequence ids."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    @classmethod
    def from_tokenizer_json(cls, tokenizer_json: bytes, vocab_size: int,
                            end_token_ids: Sequence[int]) -> GrammarTokenizer:
        """A Hugging Face tokenizer.json; ids past it (padding up to vocab_size) are never allowed."""
        return cls(llguidance.LLTokenizer(tokenizer_json.decode(), n_vocab=vocab_size,
                                          eos_token=list(end_token_ids)), vocab_size)

    @classmethod
    def from_bytes(cls, vocab_size: int, eos_token_id: int, bos_token_id: int) -> GrammarTokenizer:
        """The byte tokenizer: id = byte value for 0..255, special ids above carry no text."""
        return cls(llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(vocab_size, eos_token_id,
                                                                                  bos_token_id))), vocab_size)


class _ByteTokens:
    """What llguidance.TokenizerWrapper reads of a tokenizer, for the byte tokenizer."""

    def __init__(self, vocab_size: int, eos_token_id: int, bos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id if bos_token_id >= 0 else None
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


class Guide:
    """One sequence's matcher: which token ids may come next, given the output so far."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer.tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise GrammarError(f"the grammar does not load: {self._matcher.get_error()}")
        self._vocab_size = tokenizer.vocab_size
        self.grammar = grammar
        self._num_consumed = 0

    def allowed(self, output_token_ids: Sequence[int]) -> np.ndarray:
        """bool[vocab_size]: the ids the grammar takes after `output_token_ids` (the whole output so
        far; the ones not consumed yet are consumed first)."""
        pending = list(output_token_ids[self._num_consumed :])
        if pending and not self._matcher.consume_tokens(pending):
            raise GrammarError(f"the output left the grammar: {self._matcher.get_error()}")
        self._num_consumed = len(output_token_ids)
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = bits[: self._vocab_size].astype(bool)
        if not allowed.any():
            raise GrammarError(f"the grammar allows no token: {self._matcher.get_error() or 'stopped'}")
        return allowed
