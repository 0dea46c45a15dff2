"""Predicted time to first token (TTFT) and per output token (TPOT) on one worker, learned online.

A step's time grows with what it computes: a fixed cost (launch, sampling, the round trip to the
worker), a cost per running sequence (decode attention reads its KV cache) and a cost per token it
computes (prefill is matrix work proportional to tokens). `StepTimeModel` fits

    step_time_s = base_s + per_seq_s * num_seqs + per_token_s * num_tokens

by exponentially weighted least squares over the steps the worker reported, so the fit follows a
worker whose speed changes (a warm cache, a co-tenant on the GPU) and forgets old batches. With
few or degenerate observations (every step the same batch) or a coefficient that comes out negative
the term is dropped and the rest refitted, down to the mean step time the scheduler knew before.

A step's time is wall clock from sending it to its result, so a frozen process (SIGSTOP) or a
starved one (a busy box) makes one step look seconds long. Least squares trusts it whole, and a
lone step of an unusual batch has the leverage to set the fit on its own: one 5 s step among 9 ms
ones read as "one step alone takes 474 ms". So the fit learns robustly: a step measured over
`OUTLIER_RATIO` times its prediction is learned as that many times it (clipped: a freeze moves the
fit a little and is forgotten; a batch the fit has not seen, such as the first long prefill, is
still learned, the limit growing with each), and `SHIFT_STEPS` steps in a row off the prediction
by more than `SHIFT_TOLERANCE` the same way (the steps of one command counting once) are a worker whose speed changed: the fit keeps
`SHIFT_KEEP` of its history and learns them as measured, so a sustained slowdown is learned in
tens of steps, not hundreds.

`LatencyPredictor` turns the fit into the two numbers an objective is judged on:

- TTFT of a new sequence: the steps until it has both a slot and its prompt computed, each step
  timed next to the running decodes. Tokens: the prefill tokens queued ahead of it (at or above its
  class, minus what the prefix cache already holds) plus its own uncached prompt tokens, computed at
  most the step's token budget less the decodes per step. Slots: at `max_num_seqs` running, it waits
  for sequences to finish (`steps_until_slot`): under overload the slots, not the tokens, are what a
  newcomer waits for, and a prediction from tokens alone reads far too low;
  Steps already in flight come first: a newcomer's first step is planned behind them. Classes are
  strict, so while it waits the higher classes' new arrivals go first too: with them holding or
  waiting for a share of the slots, only the rest of the slots' turnover serves its queue, and its
  wait stretches by 1 / (1 - share) (`wait_stretch`, a priority queue's lower class; capped, a
  starved class). Without it a batch stream admitted under an interactive class that fills every
  slot was predicted ~90 ms and waited ~5 s (bench_slo, tinylm at 2x);
- TPOT: one decode step with the running sequences and this one.

Pure: no clock, no I/O; the step loop feeds it each step's measured time.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.priority import Priority

# Weight of one new step against the fit so far: ~200 steps of memory (a couple of seconds at 10 ms).
DEFAULT_DECAY = 0.995
# Sequences queued ahead that steps_until_slot() places one by one; the rest by their mean (bounded cost).
MAX_SIMULATED_WAITING = 256
# Ridge on the slopes, so a fit from nearly identical batches stays finite and near the mean.
_RIDGE = 1e-6
# A step measured over this many times the fit's prediction for its batch (a freeze, a starved step) is
# learned as this many times the prediction, unless it is part of a shift (below).
OUTLIER_RATIO = 3.0
# This many steps in a row measured off the prediction by more than SHIFT_TOLERANCE (times, either way) are
# a worker whose speed changed: the fit keeps SHIFT_KEEP of its history and learns them as measured.
SHIFT_STEPS = 5
SHIFT_TOLERANCE = 1.25
SHIFT_KEEP = 0.1
# A share of the slots held or waited for by higher classes above this reads as this share: the lower class's
# wait is at most 1 / (1 - MAX_HIGHER_SHARE) times what the queue ahead alone takes (a starved class).
MAX_HIGHER_SHARE = 0.95
# Weight of one step in the smoothed share of slots each class and those above it hold or wait for.
SHARE_ALPHA = 0.05


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
        # Steps in a row measured off the prediction the same way (+1 slower, -1 faster), and how many.
        self._shift_sign = 0
        self._num_shifted = 0
        # The last time measured, to tell the steps of one command apart (observe's `shared`).
        self._last_measured_s = -1.0

    def observe(self, num_seqs: int, num_tokens: int, step_time_s: float, *, shared: bool = False) -> float | None:
        """One step the worker ran: how many sequences, tokens computed, and what it took. `shared`: the
        time is the step's even share of a command of several steps (their results came back together,
        step_pacing.py): the command's steps count once toward a shift, or one frozen command of 8 steps
        would read as a worker that got slower. Returns the time learned (the measured one, or clipped as
        an outlier); None: nothing learned."""
        if num_seqs <= 0 or num_tokens <= 0 or not math.isfinite(step_time_s) or step_time_s < 0:
            return None  # an empty step or a bad timing teaches nothing
        if self.num_observed > 0:  # before the first step the prediction is the configured guess
            step_time_s = self._robust(self._cost.step_time_s(num_seqs, num_tokens), step_time_s, shared)
        x = (1.0, float(num_seqs), float(num_tokens))
        for i in range(3):
            self._xy[i] = self._decay * self._xy[i] + x[i] * step_time_s
            for j in range(3):
                self._xx[i][j] = self._decay * self._xx[i][j] + x[i] * x[j]
        self.num_observed += 1
        self._cost = self._fit()
        return step_time_s

    def _robust(self, predicted_s: float, measured_s: float, shared: bool) -> float:
        """What a step measured `measured_s` teaches, against `predicted_s` for its batch."""
        if predicted_s <= 0:
            return measured_s
        if measured_s > predicted_s * SHIFT_TOLERANCE:
            sign = 1
        elif measured_s * SHIFT_TOLERANCE < predicted_s:
            sign = -1
        else:
            self._shift_sign = self._num_shifted = 0
            return measured_s
        if sign != self._shift_sign:
            self._num_shifted = 1
        elif not (shared and measured_s == self._last_measured_s):  # the same command's next step
            self._num_shifted += 1
        self._shift_sign, self._last_measured_s = sign, measured_s
        if self._num_shifted >= SHIFT_STEPS:
            self._forget(SHIFT_KEEP)
            self._num_shifted = 0
            return measured_s
        return min(measured_s, predicted_s * OUTLIER_RATIO)

    def _forget(self, keep: float) -> None:
        for i in range(3):
            self._xy[i] *= keep
            for j in range(3):
                self._xx[i][j] *= keep

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

    def predict(self, *, num_tokens_ahead: int, num_prompt_tokens: int, num_running: int,
                num_steps_to_slot: int = 0, token_budget: int | None = None,
                num_steps_in_flight: int = 0, higher_share: float = 0.0) -> LatencyPrediction:
        """num_tokens_ahead: prefill tokens queued before it (cache hits already taken off);
        num_prompt_tokens: its own prompt tokens to compute (its cache hit taken off);
        num_running: sequences decoding now, each taking a token of every step's budget;
        num_steps_to_slot: steps before a slot is free for it (steps_until_slot);
        token_budget: tokens a step computes at most (None: max_num_batched_tokens; less when steps are
        paced to a TPOT target);
        num_steps_in_flight: steps sent to the worker and not back: its first step goes behind them, and
        on average the oldest is half done;
        higher_share: the share of the slots that strictly higher classes hold or wait for (smoothed over
        steps): they go first, so its wait for what is ahead of it stretches (wait_stretch)."""
        budget = self.max_num_batched_tokens if token_budget is None else max(1, min(token_budget,
                                                                                    self.max_num_batched_tokens))
        num_seqs = min(num_running + 1, self.max_num_seqs)
        decode_tokens = min(num_running, budget - 1)
        prefill_per_step = budget - decode_tokens
        own_tokens = max(num_prompt_tokens, 1)
        tokens = max(num_tokens_ahead, 0) + own_tokens
        # Each step costs its decodes' time; every prompt token ahead and its own is computed once in one of them.
        own_steps = -(-own_tokens // prefill_per_step)
        num_wait_steps = max(-(-tokens // prefill_per_step), num_steps_to_slot + own_steps) - own_steps
        num_steps = num_wait_steps * wait_stretch(higher_share) + own_steps
        if num_steps_in_flight > 0:
            num_steps += num_steps_in_flight - 0.5
        cost = self.model.cost
        ttft_s = num_steps * cost.step_time_s(num_seqs, decode_tokens) + cost.per_token_s * tokens
        tpot_s = self.model.step_time_s(num_seqs, num_seqs)
        return LatencyPrediction(ttft_s=ttft_s, tpot_s=tpot_s)

    def min_ttft_s(self) -> float:
        """The least TTFT any request could have here: one step computing a one-token prompt alone."""
        return self.model.step_time_s(1, 1)


def wait_stretch(higher_share: float) -> float:
    """How many times longer a class waits for what is queued ahead of it while strictly higher classes hold
    or wait for `higher_share` of the slots: their arrivals meanwhile go first, and only the rest of the
    slots' turnover is its own (1 / (1 - share), as a priority queue's lower class; at most
    1 / (1 - MAX_HIGHER_SHARE): a class that higher ones fill every slot for is starved)."""
    return 1.0 / (1.0 - min(max(higher_share, 0.0), MAX_HIGHER_SHARE))


def slot_shares(num_slots: int, num_by_class: dict[Priority, int]) -> dict[Priority, float]:
    """Each class's share of `num_slots` with every class above it: the sequences of those classes running
    or waiting (`num_by_class`), at most 1."""
    shares: dict[Priority, float] = {}
    num = 0
    for priority in Priority:  # highest class first
        num += num_by_class.get(priority, 0)
        shares[priority] = min(1.0, num / num_slots)
    return shares


def steps_until_slot(num_slots: int, running_steps_left: Iterable[int], waiting_steps: Iterable[int]) -> int:
    """Steps before a new sequence gets one of `num_slots` slots: the running sequences it cannot
    displace hold theirs for `running_steps_left` more steps each (tokens left to their max_tokens;
    one that stops early frees it sooner), and each sequence queued ahead of it takes the first slot
    to free for its own `waiting_steps`. 0: a slot is free now (or will be for it)."""
    held = sorted(running_steps_left)
    if len(held) < num_slots:
        held = [0] * (num_slots - len(held)) + held
    elif len(held) > num_slots:
        held = held[len(held) - num_slots:]  # more running than slots: the longest hold what stays
    if not held:
        return 0
    heapq.heapify(held)
    rest: list[int] = []
    for index, steps in enumerate(waiting_steps):
        if index < MAX_SIMULATED_WAITING:
            heapq.heapreplace(held, held[0] + max(steps, 1))
        else:
            rest.append(max(steps, 1))
    if rest:  # a deep queue: every slot turns over len(rest) / slots more times, at their mean length
        return held[0] + math.ceil(len(rest) * (sum(rest) / len(rest)) / len(held))
    return held[0]
