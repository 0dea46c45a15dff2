"""Next-token choice: greedy, or temperature + top-p with a seeded, position-keyed draw.

The random draw for generated token i depends only on (seed, i), never on how
many steps or which batch produced the logits. A sequence preempted and
recomputed on any worker therefore samples the same tokens again (up to float
noise in its logits).
"""

from __future__ import annotations

import math

import numpy as np

from services.worker.work import SamplingParams


def check_sampling(params: SamplingParams) -> None:
    """ValueError for parameters no distribution can be built from."""
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {params.temperature}")
    if not math.isfinite(params.top_p) or not 0 <= params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (0 means 1), got {params.top_p}")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {params.seed}")


def uniform_draw(seed: int, index: int) -> float:
    """A uniform number in [0, 1) determined by (seed, index) alone."""
    return float(np.random.default_rng([index, seed]).random())


def sample_token(logits: np.ndarray, params: SamplingParams, *, seed: int, index: int) -> tuple[int, float]:
    """Token id and its log-probability for `logits float[vocab]`.

    Greedy (temperature 0) returns the argmax and its log-probability under
    softmax(logits). Otherwise the distribution is softmax(logits / temperature)
    cut to the smallest top-probability set whose mass reaches top_p and
    renormalized; the logprob is under that distribution.
    """
    logits = np.asarray(logits, dtype=np.float64)
    if params.temperature == 0:
        token = int(np.argmax(logits))
        return token, float(logits[token] - _logsumexp(logits))
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
    return int(order[choice]), float(math.log(kept[choice]))


def _logsumexp(x: np.ndarray) -> float:
    peak = x.max()
    return float(peak + math.log(np.exp(x - peak).sum()))
