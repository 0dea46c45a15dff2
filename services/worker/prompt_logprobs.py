"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs): how likely the model found
each prompt token, from the logits at the position before it.

They are the raw log_softmax(logits) of the model, float64 from its float32 logits: no temperature,
penalty, logit_bias or grammar (those shape what is sampled, and nothing is sampled at a prompt
position), as vLLM computes them. A prompt chunk [s, e) computes the logits at positions s..e-1,
which predict the tokens at s+1..e: those inside the chunk, then the first of the next chunk
(`next_token_id`, which the scheduler sends). The prompt's first token is predicted by nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.common.logprobs import MAX_TOP_LOGPROBS, PositionLogprobs, TokenLogprob


def chunk_targets(token_ids: Sequence[int], next_token_id: int | None) -> tuple[int, ...]:
    """The prompt tokens a chunk's logits predict, in the order of its rows."""
    return tuple(token_ids[1:]) + (() if next_token_id is None else (next_token_id,))


def prompt_logprobs(logits: np.ndarray, targets: Sequence[int], num_top: int) -> tuple[PositionLogprobs, ...]:
    """For row i of `logits float32[len(targets), vocab]`: targets[i]'s logprob and the `num_top`
    most likely tokens, most likely first (ties: lower id first)."""
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    if len(logits) != len(targets):
        raise ValueError(f"{len(logits)} rows of logits for {len(targets)} prompt tokens")
    if not len(targets):
        return ()
    rows = np.asarray(logits, dtype=np.float64)
    peak = rows.max(axis=1, keepdims=True)
    log_probs = rows - (peak + np.log(np.exp(rows - peak).sum(axis=1, keepdims=True)))
    ids = np.asarray(targets, dtype=np.int64)
    chosen = log_probs[np.arange(len(ids)), ids]
    k = min(num_top, log_probs.shape[1])
    tops: list[tuple[TokenLogprob, ...]] = [()] * len(ids)
    if k:
        # argpartition: O(vocab) per row for the k largest, then only those k sorted.
        candidates = np.argpartition(-log_probs, k - 1, axis=1)[:, :k]
        values = np.take_along_axis(log_probs, candidates, axis=1)
        for i in range(len(ids)):
            order = np.lexsort((candidates[i], -values[i]))
            tops[i] = tuple(TokenLogprob(int(candidates[i][j]), float(values[i][j])) for j in order)
    return tuple(PositionLogprobs(TokenLogprob(int(t), float(v)), top)
                 for t, v, top in zip(ids, chosen, tops, strict=True))
