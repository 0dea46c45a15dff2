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
from services.worker.work import SamplingParams

# Penalties' bounds (OpenAI's for presence and frequency; repetition's upper bound alike), logit_bias's
# value bound (OpenAI's) and entry count (the scheduler refuses the same).
MAX_PENALTY = 2.0
MAX_BIAS = 100.0
MAX_LOGIT_BIAS = 1024


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
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {params.top_logprobs}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
    if not (math.isfinite(params.repetition_penalty) and 0 < params.repetition_penalty <= MAX_PENALTY):
        raise ValueError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {params.repetition_penalty}")
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
    cut to the smallest top-probability set whose mass reaches top_p and
    renormalized; `Sample.logprob` is under that distribution. The logprobs a request asks
    for (`params.logprobs`) are those of log_softmax(logits / temperature), temperature 0 read
    as 1, before the cut: the same logits the draw uses, as OpenAI and vLLM report them.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if params.temperature == 0:
        token = int(np.argmax(logits))
        log_probs = logits - _logsumexp(logits)
        return Sample(token, float(log_probs[token]), _reported(log_probs, token, params))
    scaled = logits / params.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    top_p = params.top_p or 1.0
    cumulative = np.cumsum(sorted_probs)
    num_kept = min(len(order), int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1)
    kept = sorted_probs[:num_kept] / cumulative[num_kept - 1]
    choice = int(np.searchsorted(np.cumsum(kept), uniform_draw(seed, index), side="right"))
    choice = min(choice, num_kept - 1)  # guards the draw against rounding at the top of the cumulative sum
    token = int(order[choice])
    reported = None
    if params.logprobs:
        reported = _reported(scaled - _logsumexp(scaled), token, params, order)
    return Sample(token, float(math.log(kept[choice])), reported)


def _reported(log_probs: np.ndarray, token: int, params: SamplingParams,
              order: np.ndarray | None = None) -> PositionLogprobs | None:
    """The sampled token's logprob and the top_logprobs largest; `order`: indices by descending
    probability, ties by lower id, when the caller has them."""
    if not params.logprobs:
        return None
    k = min(params.top_logprobs, len(log_probs))
    if order is None and k:
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
