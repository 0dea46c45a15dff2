"""Prompt logprobs (vLLM's prompt_logprobs, OpenAI's echo with logprobs): how likely the model found
each prompt token, from the logits at the position before it.

They are the raw log_softmax(logits) of the model, in float32 as its logits are: no temperature,
penalty, logit_bias or grammar (those shape what is sampled, and nothing is sampled at a prompt
position), as vLLM computes them. A prompt chunk [s, e) computes the logits at positions s..e-1,
which predict the tokens at s+1..e: those inside the chunk, then the first of the next chunk
(`next_token_id`, which the scheduler sends). The prompt's first token is predicted by nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.common.logprobs import MAX_TOP_LOGPROBS, PositionLogprobs, TokenLogprob


def chunk_targets(token_ids: Sequence[int], next_token_id: int | None) -> tuple[int, ...]:
    """The prompt tokens a chunk's logits predict, in the order of its rows."""
    return tuple(token_ids[1:]) + (() if next_token_id is None else (next_token_id,))


def prompt_logprobs(logits: torch.Tensor | np.ndarray, targets: Sequence[int],
                    num_top: int) -> tuple[PositionLogprobs, ...]:
    """For row i of `logits float32[len(targets), vocab]`: targets[i]'s logprob and the `num_top`
    most likely tokens, most likely first (ties: lower id first)."""
    if not 0 <= num_top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {num_top}")
    if len(logits) != len(targets):
        raise ValueError(f"{len(logits)} rows of logits for {len(targets)} prompt tokens")
    if not len(targets):
        return ()
    # torch, float32: a whole chunk's rows at once (256 rows x 32 000 tokens: ~40-70 ms here, where
    # NumPy in float64 took 0.4-0.9 s), within ~1e-6 of a float64 log_softmax.
    log_probs = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float32), dim=-1)
    ids = torch.as_tensor(list(targets), dtype=torch.int64)
    chosen = log_probs[torch.arange(len(ids)), ids].tolist()
    k = min(num_top, log_probs.shape[1])
    tops: list[tuple[TokenLogprob, ...]] = [()] * len(ids)
    if k:
        tops = [tuple(TokenLogprob(t, v) for t, v in row) for row in _top(log_probs, k)]
    return tuple(PositionLogprobs(TokenLogprob(t, v), top)
                 for t, v, top in zip(ids.tolist(), chosen, tops, strict=True))


def _top(log_probs: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """Each row's k largest (id, value), largest first, ties by lower id: topk picks among tokens tied
    at the k-th value arbitrarily, so a row with such a tie is settled over all of them (rare)."""
    # One more than k: a row whose (k+1)-th value equals its k-th has a tie at the boundary.
    values, candidates = torch.topk(log_probs, min(k + 1, log_probs.shape[1]), dim=-1)
    kth = values[:, k - 1 : k]
    tied_rows = (values[:, k:].eq(kth).any(dim=1)).nonzero().flatten().tolist() if values.shape[1] > k else []
    rows = [sorted(zip(ids[:k], vals[:k], strict=True), key=lambda pair: (-pair[1], pair[0]))
            for ids, vals in zip(candidates.tolist(), values.tolist(), strict=True)]
    for r in tied_rows:
        ids = (log_probs[r] >= kth[r]).nonzero().flatten()
        pairs = zip(ids.tolist(), log_probs[r, ids].tolist(), strict=True)
        rows[r] = sorted(pairs, key=lambda pair: (-pair[1], pair[0]))[:k]
    return rows
