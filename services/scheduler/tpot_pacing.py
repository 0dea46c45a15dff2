"""Per-token pacing: one step's time held within the tightest TPOT target running, and who may skip a step.

A step's time grows with what it holds (latency_predictor.StepCost), and every sequence in it waits
for the whole step. So a batch-class sequence (TPOT target 1 s) decoding in every step next to
interactive ones (50 ms), and the prompt chunks of newcomers, lengthen every interactive token. Two
rules keep the interactive class's TPOT, using what the scheduler already knows:

- the cap: a step may take what keeps every running sequence's TPOT within PACE_MARGIN x its target
  (the margin leaves room for the hops to the client and for the fit's error). TPOT is a stream's
  mean time per token after the first (as the gateway and DistServe judge it), so one longer step
  is paid for by the stream's other steps being shorter than its pace: d seconds after its first
  token, with k tokens since and r more after this step (to max_tokens; one that stops sooner has
  fewer to spread it over, so the cap is bounded below), whose steps take what steps take now (s),
  the next step may take (k + 1 + r) x margin x target - d - r x s, at least margin x target (a
  stream behind its pace is not made to catch up by starving the rest) and at most
  MAX_SLACK_STEPS x margin x target (no one step stalls a stream for long). The cap is the least
  of these over the running sequences with a target and a first token; prompt chunks are cut to fit
  it, and a decode that may skip (below) waits when it would not fit;
- skipping: a decode may sit out a step while a sequence of a strictly higher class runs or waits
  ("an interactive class behind it"), as long as its own next token still comes within its own TPOT
  target: skipped now, it is picked in the next step, which ends about two steps from now. Such
  decodes give way only to a higher class: they are picked after the decodes that may not skip and
  after the prompt chunks and admissions of strictly higher classes, before those of their own class
  or below, in class order and longest since their last token first (so they take turns), while the
  cap and the token budget allow. A sequence without a target never skips, and with no target
  running there is no cap: the step is planned exactly as before objectives existed.

The cap never cuts a step's prompt tokens below PACE_MIN_PROMPT_TOKENS: with a TPOT target that the
decodes alone nearly fill, pacing would otherwise admit no newcomer for as long as that one stream
runs (a client could stall every other one by asking for such a target).

Pure: no clock (the caller passes `now_s`), no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.priority import Priority
from services.scheduler.latency_predictor import StepCost
from services.scheduler.sequence import Sequence

# A step may take this fraction of the tightest running TPOT target (the rest: hops, jitter, fit error).
PACE_MARGIN = 0.8
# The longest step the cap allows, in paced steps (margin x target): slack is spent a little at a time.
MAX_SLACK_STEPS = 2.0
# Prompt tokens a step may always compute, cap or not: a target the running decodes alone nearly fill
# (or a fit that reads the box's contention as step time) must not stop every newcomer's prefill.
PACE_MIN_PROMPT_TOKENS = 16
# A skipped decode's next token comes about this many steps after the last one: this one and the next.
_STEPS_TO_NEXT_TOKEN_IF_SKIPPED = 2


@dataclass(frozen=True)
class StepPace:
    """The pacing of one step being planned (module docstring)."""

    cost: StepCost
    # The longest the step may take, seconds.
    cap_s: float
    # The class of the highest-class sequence running or waiting: lower classes may skip for it.
    top_priority: Priority
    # What a step takes now (the scheduler's smoothed step time), for a skipped decode's next token.
    step_s: float
    now_s: float

    def may_skip(self, seq: Sequence) -> bool:
        """Whether `seq`'s decode may sit out this step: it has a TPOT target and a first token, a sequence
        of a strictly higher class is here, and its next token still comes within its target."""
        return seq.num_uncomputed_tokens == 1 and self.may_skip_at(seq, seq.last_token_s, self.now_s)

    def may_skip_at(self, seq: Sequence, last_token_s: float | None, start_s: float) -> bool:
        """may_skip() for the decode of a step starting at `start_s`, after `seq`'s latest token came (or
        comes, a step in flight sampling it) at `last_token_s` (None: no token yet): a step planned ahead."""
        target_s = seq.tpot_target_s
        if target_s is None or last_token_s is None or seq.priority <= self.top_priority:
            return False
        next_token_s = start_s + _STEPS_TO_NEXT_TOKEN_IF_SKIPPED * self.step_s
        return next_token_s - last_token_s <= target_s * PACE_MARGIN

    def tokens_allowed(self, num_seqs: int, num_tokens: int) -> int:
        """Tokens one more sequence may compute in a step already holding `num_seqs` sequences and
        `num_tokens` tokens, the step staying within the cap (0: none; the caller adds the floor of
        PACE_MIN_PROMPT_TOKENS)."""
        spare_s = self.cap_s - self.cost.step_time_s(num_seqs + 1, num_tokens)
        if spare_s < 0:
            return 0
        if self.cost.per_token_s <= 0:
            return 1 << 30
        return math.floor(spare_s / self.cost.per_token_s)

    def token_budget(self, num_running: int) -> int:
        """Tokens a step with `num_running` sequences and one more may compute within the cap (the
        predictor's budget per step; at least the decodes and PACE_MIN_PROMPT_TOKENS)."""
        return max(num_running + PACE_MIN_PROMPT_TOKENS, self.tokens_allowed(num_running, 0))


def step_pace(cost: StepCost, running: Iterable[Sequence], waiting_top: Priority | None, *, step_s: float,
              now_s: float) -> StepPace | None:
    """The pace of the next step: None when no running sequence has a TPOT target and a first token (no
    cap, no skips). `waiting_top`: the highest class waiting, if any."""
    caps: list[float] = []
    top = waiting_top
    for seq in running:
        if seq.tpot_target_s is not None and seq.first_token_s is not None:
            caps.append(step_cap_s(seq.tpot_target_s, seq.num_generated - seq.first_token_index,
                                   now_s - seq.first_token_s, seq.sampling.max_tokens - seq.num_generated - 1,
                                   step_s))
        if top is None or seq.priority < top:
            top = seq.priority
    if not caps or top is None:
        return None
    return StepPace(cost, cap_s=min(caps), top_priority=top, step_s=step_s, now_s=now_s)


def step_cap_s(tpot_target_s: float, num_tokens_after_first: int, since_first_s: float, num_tokens_after_next: int,
               step_s: float) -> float:
    """The longest next step that keeps a stream's mean time per token after its first within
    PACE_MARGIN x its target, its later steps taking `step_s`, between one and MAX_SLACK_STEPS paced
    steps (module docstring)."""
    paced_s = PACE_MARGIN * tpot_target_s
    num_later = max(num_tokens_after_next, 0)
    with_slack_s = (num_tokens_after_first + 1 + num_later) * paced_s - since_first_s - num_later * step_s
    return min(max(with_slack_s, paced_s), MAX_SLACK_STEPS * paced_s)
