"""Predicted time to first token (TTFT) and per output token (TPOT) on one worker, learned online.

A step's time grows with what it computes: a fixed cost (launch, sampling, the round trip to the
worker), a cost per running sequence (decode attention reads its KV cache) and a cost per token it
computes (prefill is matrix work proportional to tokens). `StepTimeModel` fits

    step_time_s = base_s + per_seq_s * num_seqs + per_token_s * num_tokens

by exponentially weighted least squares over the steps the worker reported, so the fit follows a
worker whose speed changes (a warm cache, a co-tenant on the GPU) and forgets old batches. With
few or degenerate observations (every step the same batch) or a coefficient that comes out negative
the term is dropped and the rest refitted, down to the mean step time the scheduler knew before.

`LatencyPredictor` turns the fit into the two numbers an objective is judged on:

- TTFT of a new sequence: the prefill tokens queued ahead of it (at or above its class, minus what
  the prefix cache already holds) plus its own uncached prompt tokens, computed at most
  `max_num_batched_tokens` per step next to the running decodes, plus the step that samples its first
  token;
- TPOT: one decode step with the running sequences and this one.

Pure: no clock, no I/O; the step loop feeds it each step's measured time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Weight of one new step against the fit so far: ~200 steps of memory (a couple of seconds at 10 ms).
DEFAULT_DECAY = 0.995
# Ridge on the slopes, so a fit from nearly identical batches stays finite and near the mean.
_RIDGE = 1e-6


@dataclass(frozen=True)
class StepCost:
    """The fitted step time: base_s + per_seq_s * sequences + per_token_s * tokens (all >= 0)."""

    base_s: float
    per_seq_s: float
    per_token_s: float

    def step_time_s(self, num_seqs: int, num_tokens: int) -> float:
        return self.base_s + self.per_seq_s * num_seqs + self.per_token_s * num_tokens


class StepTimeModel:
    """Online weighted least squares of step time on (sequences, tokens) in the step."""

    def __init__(self, initial_step_time_s: float, *, decay: float = DEFAULT_DECAY) -> None:
        if not initial_step_time_s > 0:
            raise ValueError(f"initial_step_time_s must be > 0, got {initial_step_time_s}")
        if not 0 < decay < 1:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self._decay = decay
        self._initial_s = initial_step_time_s
        # Weighted sums of x x^T and x y over x = (1, num_seqs, num_tokens), y = step time.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self.num_observed = 0
        self._cost = StepCost(initial_step_time_s, 0.0, 0.0)

    def observe(self, num_seqs: int, num_tokens: int, step_time_s: float) -> None:
        """One step the worker ran: how many sequences, tokens computed, and what it took."""
        if num_seqs <= 0 or num_tokens <= 0 or not math.isfinite(step_time_s) or step_time_s < 0:
            return  # an empty step or a bad timing teaches nothing
        x = (1.0, float(num_seqs), float(num_tokens))
        for i in range(3):
            self._xy[i] = self._decay * self._xy[i] + x[i] * step_time_s
            for j in range(3):
                self._xx[i][j] = self._decay * self._xx[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._cost = self._fit()

    @property
    def cost(self) -> StepCost:
        return self._cost

    def step_time_s(self, num_seqs: int, num_tokens: int) -> float:
        return self._cost.step_time_s(num_seqs, num_tokens)

    def _fit(self) -> StepCost:
        """Least squares with every coefficient >= 0: a term whose coefficient comes out negative (noise
        on a narrow range of batches) is dropped and the rest refitted; none left: the mean step."""
        weight = self._xx[0][0]
        active = [0, 1, 2]
        while active:
            system = [[self._xx[i][j] + (_RIDGE * max(self._xx[i][i], weight) if i == j and i > 0 else 0.0)
                       for j in active] for i in active]
            solution = _solve(system, [self._xy[i] for i in active])
            if solution is None:
                active.pop()
                continue
            negative = [k for k, value in enumerate(solution) if value < 0]
            if not negative:
                coefficients = [0.0, 0.0, 0.0]
                for k, i in enumerate(active):
                    coefficients[i] = solution[k]
                return StepCost(*coefficients)
            active.pop(min(negative, key=lambda k: solution[k]))
        return StepCost(self._xy[0] / weight, 0.0, 0.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small system; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


@dataclass(frozen=True)
class LatencyPrediction:
    ttft_s: float
    tpot_s: float


class LatencyPredictor:
    """TTFT and TPOT of a new sequence on one worker, from its queue and the fitted step cost."""

    def __init__(self, model: StepTimeModel, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens

    def predict(self, *, num_tokens_ahead: int, num_prompt_tokens: int, num_running: int) -> LatencyPrediction:
        """num_tokens_ahead: prefill tokens queued before it (cache hits already taken off);
        num_prompt_tokens: its own prompt tokens to compute (its cache hit taken off);
        num_running: sequences decoding now, each taking a token of every step's budget."""
        num_seqs = min(num_running + 1, self.max_num_seqs)
        decode_tokens = min(num_running, self.max_num_batched_tokens - 1)
        prefill_per_step = self.max_num_batched_tokens - decode_tokens
        tokens = max(num_tokens_ahead, 0) + max(num_prompt_tokens, 1)
        num_full_steps, last = divmod(tokens, prefill_per_step)
        ttft_s = num_full_steps * self.model.step_time_s(num_seqs, self.max_num_batched_tokens)
        if last:
            ttft_s += self.model.step_time_s(num_seqs, decode_tokens + last)
        tpot_s = self.model.step_time_s(num_seqs, num_seqs)
        return LatencyPrediction(ttft_s=ttft_s, tpot_s=tpot_s)

    def min_ttft_s(self) -> float:
        """The least TTFT any request could have here: one step computing a one-token prompt alone."""
        return self.model.step_time_s(1, 1)
