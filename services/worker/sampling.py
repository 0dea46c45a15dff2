"""Next-token choice: greedy, or temperature + top-p with a seeded, position-keyed draw.

The random draw for generated token i depends only on (seed, i), never on how
many steps or which batch produced the logits. A sequence preempted and
recomputed on any worker therefore samples the same tokens again (up to float
noise in its logits).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.common.logprobs import MAX_TOP_LOGPROBS, PositionLogprobs, TokenLogprob
from services.common.sampling_bounds import MAX_ALLOWED_TOKEN_IDS, MAX_BIAS, MAX_LOGIT_BIAS, MAX_PENALTY
from services.worker.work import SamplingParams


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float  # under the distribution drawn from (after the top_p cut), as SequenceOutput.logprob
    logprobs: PositionLogprobs | None = None  # with params.logprobs: under log_softmax(logits / temperature)


def check_sampling(params: SamplingParams) -> None:
    """ValueError for parameters no distribution can be built from."""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not math.isfinite(params.top_p) or not 0 <= params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (0 means 1), got {params.top_p}")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {params.seed}")
    if params.top_k < 0 or not (math.isfinite(params.min_p) and 0 <= params.min_p <= 1):
        raise ValueError(f"top_k must be >= 0 and min_p in [0, 1], got {params.top_k} and {params.min_p}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if not (math.isfinite(params.repetition_penalty) and 0 < params.repetition_penalty <= MAX_PENALTY):
        raise ValueError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {params.repetition_penalty}")
    if len(params.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
        raise ValueError(f"allowed_token_ids holds {len(params.allowed_token_ids)} ids; at most "
                         f"{MAX_ALLOWED_TOKEN_IDS} are allowed")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias holds {len(params.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    for token_id, bias in params.logit_bias:
        if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise ValueError(f"logit_bias[{token_id}] must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")


def uniform_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) determined by (seed, index) alone."""
    return float(np.random.default_rng([index, seed]).random())


def sample_token(logits: np.ndarray, params: SamplingParams, *, seed: int, index: int) -> tuple[int, float]:
    """`sample()`'s token id and its log-probability under the distribution drawn from."""
    drawn = sample(logits, params, seed=seed, index=index)
    return drawn.token_id, drawn.logprob


def without_banned(logits: np.ndarray, banned: Sequence[int]) -> np.ndarray:
    """A copy of `logits` with the `banned` ids at -inf (min_tokens' end ids), or `logits` itself when
    that would leave nothing to draw (a grammar that allows only the end wins over min_tokens)."""
    kept = np.array(logits, dtype=np.float64)
    kept[list(banned)] = -math.inf
    return kept if np.isfinite(kept).any() else logits


def only_allowed(logits: np.ndarray, allowed: Sequence[int]) -> np.ndarray | None:
    """A copy of `logits` with every id but the `allowed` ones at -inf (vLLM's allowed_token_ids), or None
    when none of those is finite (a grammar allows none of them here): the caller fails the sequence, as
    drawing any token would break either the grammar or the list."""
    ids = np.fromiter(allowed, dtype=np.int64, count=len(allowed))
    kept = np.full(len(logits), -math.inf)
    kept[ids] = logits[ids]
    return kept if np.isfinite(kept[ids]).any() else None


def processed_logits(logits: np.ndarray, params: SamplingParams, token_ids: Sequence[int] = (),
                     num_generated: int = 0) -> np.ndarray:
    """The logits the draw uses, float64: `logits` plus logit_bias, then the repetition penalty over
    every token of the sequence (`token_ids`: the prompt's, then the output's), then the presence
    and frequency penalties over its last `num_generated` (the output). vLLM's order and definitions;
    a function of the tokens alone, so a recomputed or resumed sequence gets the same ones."""
    logits = np.array(logits, dtype=np.float64)  # a copy: the caller's row is left as it was
    if params.logit_bias:
        biased, biases = zip(*params.logit_bias, strict=True)
        logits[list(biased)] += biases
    if not params.penalized or not token_ids:
        return logits
    tokens = np.asarray(token_ids, dtype=np.int64)
    if params.repetition_penalty != 1.0:
        seen = np.unique(tokens)
        values = logits[seen]
        logits[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if num_generated and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(tokens[len(tokens) - num_generated :], return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def sample(logits: np.ndarray, params: SamplingParams, *, seed: int, index: int) -> Sample:
    """The next token for `logits float[vocab]`.

    Greedy (temperature 0) returns the argmax and its log-probability under
    softmax(logits). Otherwise the distribution is softmax(logits / temperature)
    cut by min_p and top_k (when set), then to the smallest top-probability set whose mass reaches
    top_p, and renormalized; `Sample.logprob` is under that distribution. The token is the inverse CDF of
    `uniform_draw(seed, index)` over the kept tokens in id order: no index is sorted, and with top_p 1
    no value either. The logprobs a request asks
    for (`params.logprobs`) are those of log_softmax(logits / temperature), temperature 0 read
    as 1, before the cut: the same logits the draw uses, as OpenAI and vLLM report them.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if params.temperature == 0:
        token = int(np.argmax(logits))
        log_probs = logits - _logsumexp(logits)
        return Sample(token, float(log_probs[token]), _reported(log_probs, token, params))
    scaled = logits / params.temperature
    peak = scaled.max()
    probs = np.exp(scaled - peak)
    kept = _cut(probs, params)
    cumulative = np.cumsum(kept)
    token = _inverse_cdf(cumulative, uniform_draw(seed, index))
    reported = None
    if params.logprobs:
        reported = _reported(scaled - (peak + math.log(probs.sum())), token, params)
    return Sample(token, float(math.log(kept[token] / cumulative[-1])), reported)


def _cut(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """`probs` (unnormalized) with the tokens min_p, top_k and top_p drop set to 0, in vLLM's order: min_p
    against the most likely token, top_k (every token tied with the k-th kept, as vLLM keeps them), then
    top_p over the mass left. Each is skipped when off, so the plain draw costs nothing more."""
    kept = probs
    if params.min_p:
        kept = np.where(kept >= params.min_p * kept.max(), kept, 0.0)
    if 0 < params.top_k < len(kept):
        edge = np.partition(kept, len(kept) - params.top_k)[len(kept) - params.top_k]
        kept = np.where(kept >= edge, kept, 0.0)
    top_p = params.top_p or 1.0
    if top_p < 1.0:
        kept = np.where(_nucleus(kept, top_p), kept, 0.0)
    return kept


def _inverse_cdf(cumulative: np.ndarray, draw: float) -> int:
    """The index whose interval of `cumulative` (unnormalized) holds `draw` in [0, 1) of its total.

    An entry of probability 0 has an empty interval, so it is never chosen; past the top (rounding
    in draw * total) the last entry of positive probability is."""
    choice = int(np.searchsorted(cumulative, draw * cumulative[-1], side="right"))
    if choice < len(cumulative):
        return choice
    return int(np.searchsorted(cumulative, cumulative[-1], side="left"))


# How many of the most likely tokens a top_p cut is first assumed to keep: a peaked distribution's
# cut is found from a partition (O(vocab)) and a sort of this many; a flat one's sorts every value.
_NUCLEUS_GUESS = 64


def _nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """bool[vocab]: the smallest set of most likely tokens whose mass reaches top_p of the whole, ties
    at its edge broken by lower id (the prefix of the vocabulary stably sorted by descending probability).

    Only the probabilities' values are sorted, never their indices: the cut's value `edge` and how many
    of its ties are kept decide the set."""
    target = top_p * probs.sum()
    guess = min(_NUCLEUS_GUESS, len(probs))
    values = np.sort(np.partition(probs, len(probs) - guess)[len(probs) - guess:])[::-1]
    num_kept = int(np.searchsorted(np.cumsum(values), target)) + 1
    if num_kept > guess:
        values = np.sort(probs)[::-1]
        num_kept = min(int(np.searchsorted(np.cumsum(values), target)) + 1, len(values))
    edge = values[num_kept - 1]
    kept = probs > edge
    ties = np.flatnonzero(probs == edge)
    kept[ties[: num_kept - int(kept.sum())]] = True
    return kept


def _reported(log_probs: np.ndarray, token: int, params: SamplingParams) -> PositionLogprobs | None:
    """The sampled token's logprob and the top_logprobs largest (ties: lower id first)."""
    if not params.logprobs:
        return None
    k = min(params.top_logprobs, len(log_probs))
    order: np.ndarray | None = None
    if k:
        # argpartition: O(vocab) for the k largest, then only those k sorted (ties: lower id first).
        candidates = np.argpartition(-log_probs, k - 1)[:k]
        order = candidates[np.lexsort((candidates, -log_probs[candidates]))]
    # Tokens a grammar masked (-inf) are never among the alternatives (JSON has no -Infinity).
    top = tuple(TokenLogprob(int(t), float(log_probs[t])) for t in (order[:k] if k else ())  # type: ignore[index]
                if math.isfinite(log_probs[t]))
    return PositionLogprobs(TokenLogprob(token, float(log_probs[token])), top)


def _logsumexp(x: np.ndarray) -> float:
    peak = x.max()
    return float(peak + math.log(np.exp(x - peak).sum()))
