"""Structured output for a reasoning model: the think block sampled freely, the grammar holding only
what follows `</think>` (vLLM's structured output with a reasoning parser).

The scheduler decides per request whether a grammar waits for the reasoning (model_text.py:
ReasoningStart.grammar_after) and sends it with each step (SequenceStep.grammar_after_reasoning);
the worker reads where the grammar starts from the sequence's output tokens alone
(`grammar_start`; `GrammarScan` keeps what one sequence's steps have read), so a recompute, or a
continuation on another worker, finds the same place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarAfterReasoning:
    """Where a grammar starts in an output that may begin as reasoning."""

    # The model's `</think>`: the grammar holds the output after its first occurrence; it and every
    # token before it are sampled without a mask (the end of sequence too, as in vLLM).
    end_token_id: int
    # The model's `<think>`, for an output that is reasoning only if it begins with it (qwen3, the
    # prompt opened no block): the first token may be it or one the grammar allows, and an output
    # that begins otherwise is held by the grammar from its first token. None: the output begins as
    # reasoning (the prompt opened the block, or deepseek_r1).
    start_token_id: int | None = None

    def grammar_start(self, token_ids: Sequence[int], num_generated: int, num_scanned: int = 0) -> int | None:
        """How many output tokens (the last `num_generated` of `token_ids`) come before the first one
        the grammar holds; None: it holds none yet, so the next token is sampled freely.
        `num_scanned`: leading output tokens an earlier call on the same output found no end among
        (it only saves their scan: the answer is the same with 0)."""
        first = len(token_ids) - num_generated
        if self.start_token_id is not None and (not num_generated or token_ids[first] != self.start_token_id):
            return 0
        try:
            return token_ids.index(self.end_token_id, first + num_scanned) - first + 1
        except ValueError:
            return None

    def also_allowed(self, num_generated: int) -> int | None:
        """The id the next token may be beside those the grammar allows: the block's opening, at
        the output's first token only."""
        return self.start_token_id if not num_generated else None


class GrammarScan:
    """Where one sequence's grammar starts in its output (GrammarAfterReasoning.grammar_start), kept
    across its steps: an output only grows, so a token scanned once needs no second look. A reset
    block table starts a new scan, which finds the same place from the same tokens."""

    def __init__(self, after: GrammarAfterReasoning) -> None:
        self.after = after
        self._num_scanned = 0  # leading output tokens with no end of the block among them
        self._start: int | None = None  # the grammar's first output token, once settled

    def grammar_start(self, token_ids: Sequence[int], num_generated: int) -> int | None:
        """GrammarAfterReasoning.grammar_start of the sequence's tokens (its output: the last
        `num_generated`), scanning only the output tokens no earlier call scanned."""
        if self._start is not None:
            return self._start
        start = self.after.grammar_start(token_ids, num_generated, self._num_scanned)
        if start is None:
            self._num_scanned = num_generated
        elif num_generated:  # before the first token, an output that may open a block has not chosen
            self._start = start
        return start
