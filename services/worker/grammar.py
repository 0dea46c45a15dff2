"""Constrained sampling: the tokens a sequence's grammar allows next (llguidance).

The scheduler compiles a request's structured output into a grammar (scheduler/structured_output.py)
and sends it with each step; the worker keeps one matcher per sequence, made from the grammar on
the sequence's first sample here and fed the sequence's output tokens (the last num_generated of
its tokens) before each sample. So a table reset, a recompute or a continuation on another worker
rebuilds the same matcher from the same tokens: constrained sampling stays a function of the
tokens, the seed and the position. Once the grammar is complete only end-of-sequence ids are
allowed, so the sequence ends there.

A reasoning model's grammar may wait for its think block to end (GrammarAfterReasoning): the
matcher is then fed only the output tokens after the first `</think>`, and the tokens up to it are
sampled without a mask. Where the grammar starts is read from the output tokens too
(services/common/grammar_after_reasoning.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import llguidance
import numpy as np

# A grammar that hit one of llguidance's limits: one that forces an endless sequence (`start: "a" start`)
# runs out of parser items following the forced tokens ("parser error: Too many items (limit 50000;
# ff_tokens)"; the matcher's stop_reason() then reads InternalError, so the message is what tells).
# The caller's grammar is at fault; finding it out at admission would mean consuming every forced
# token of every grammar there (100-900 ms for one forcing a long literal).
_LIMIT_HIT = re.compile(r"\(limit \d+|too complex", re.IGNORECASE)


class GrammarError(ValueError):
    """The grammar does not load, or the output left it (the sequence fails alone). `callers`: the
    caller's grammar is at fault (one of llguidance's limits), not the worker."""

    def __init__(self, message: str, callers: bool = False) -> None:
        super().__init__(message)
        self.callers = callers


def _matcher_error(matcher: llguidance.LLMatcher, what: str) -> GrammarError:
    """The matcher's error, its first line only (llguidance appends its parser state and the grammar,
    ~1 KB, which is no use to a caller)."""
    first_line = matcher.get_error().strip().split("\n", 1)[0]
    if _LIMIT_HIT.search(first_line):
        return GrammarError(f"the grammar cannot go on past this output ({first_line}): does it force an "
                            "endless sequence?", callers=True)
    return GrammarError(f"{what}: {first_line}")


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
    """One sequence's matcher: which token ids may come next, given the output so far.

    `advance` feeds it the output tokens it has not seen, `fill_mask` writes the next token's mask
    into a bitmask row (what the step executor uses, on its mask thread: services/worker/step_masks.py);
    `allowed` does both and unpacks the row. Not thread-safe: one thread uses a guide at a time."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer.tokenizer, grammar, log_level=0)
        if self._matcher.is_error():
            raise _matcher_error(self._matcher, "the grammar does not load")
        self._vocab_size = tokenizer.vocab_size
        self._num_words = (tokenizer.tokenizer.vocab_size + 31) // 32
        self.grammar = grammar
        self.num_consumed = 0  # output tokens consumed so far

    def advance(self, token_ids: Sequence[int]) -> None:
        """Consumes the next output tokens (those after the first num_consumed)."""
        if token_ids and not self._matcher.consume_tokens(list(token_ids)):
            raise _matcher_error(self._matcher, "the output left the grammar")
        self.num_consumed += len(token_ids)

    def fill_mask(self, row: np.ndarray) -> None:
        """Writes the next token's mask into `row: int32[(tokenizer vocab + 31) // 32]` (bit t % 32 of
        word t // 32 set: token t allowed), with the GIL released while llguidance computes it."""
        if row.dtype != np.int32 or row.shape != (self._num_words,) or not row.flags.c_contiguous:
            raise ValueError(f"a mask row is int32[{self._num_words}], contiguous; got {row.dtype}{list(row.shape)}")
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        # A matcher in error state writes an end-only mask instead of failing: the error is read here.
        if self._matcher.is_error():
            raise _matcher_error(self._matcher, "the output left the grammar")
        if not row.any():
            raise GrammarError(f"the grammar allows no token ({self._matcher.stop_reason()})")

    def allowed(self, output_token_ids: Sequence[int]) -> np.ndarray:
        """bool[vocab_size]: the ids the grammar takes after `output_token_ids` (the whole output so
        far; the ones not consumed yet are consumed first)."""
        self.advance(output_token_ids[self.num_consumed :])
        row = np.zeros(self._num_words, dtype=np.int32)
        self.fill_mask(row)
        bits = np.unpackbits(row.astype("<u4", copy=False).view(np.uint8), bitorder="little")
        return bits[: self._vocab_size].astype(bool)
