"""One schedule() call's picks: the sequences chosen so far, their tokens and blocks, and the budget left.

The StepScheduler decides; the builder keeps the tally, bills tenants as service is given (so later
picks in the same step already see it), and turns the picks into the plan's `SequenceStep`s.
"""

from __future__ import annotations

from services.scheduler.sequence import Sequence
from services.scheduler.step_plan import SequenceStep
from services.scheduler.tenant_service import TenantService


class StepBuilder:
    """The sequences picked so far in one schedule() call, and what budget is left."""

    def __init__(self, token_budget: int, service: TenantService) -> None:
        self.token_budget = token_budget
        self._service = service
        # seq_id -> (sequence, tokens to compute, blocks appended this step)
        self.picked: dict[int, tuple[Sequence, int, tuple[int, ...]]] = {}
        self.preempted: list[int] = []
        # Decodes planned ahead (schedule_ahead): each computes the token a step in flight samples.
        self.ahead: list[SequenceStep] = []
        # Where a step in flight samples a running sequence's next input (schedule_ahead): seq_id ->
        # (the position of that token, tokens generated before it). Others decode from their own state.
        self.in_flight_samples: dict[int, tuple[int, int]] = {}
        # Where a prompt chunk in flight ends (schedule_ahead): seq_id -> the position its next chunk
        # starts at. Others start at their num_computed_tokens.
        self.in_flight_ends: dict[int, int] = {}
        self.num_long_prefills = 0  # picked sequences with more than one chunk of prompt left

    def pick(self, seq: Sequence, num_new_tokens: int, new_blocks: tuple[int, ...]) -> None:
        """`num_new_tokens` of `seq` from start_of(seq) on."""
        self.picked[seq.seq_id] = (seq, num_new_tokens, new_blocks)
        self.token_budget -= num_new_tokens
        self._bill(seq, num_new_tokens)

    def start_of(self, seq: Sequence) -> int:
        """Where `seq`'s next tokens start, but for a decode whose input a step in flight samples."""
        return self.in_flight_ends.get(seq.seq_id, seq.num_computed_tokens)

    def pick_ahead(self, seq: Sequence, start: int, num_generated: int, new_blocks: tuple[int, ...]) -> None:
        """A decode at `start` of the token the newest step in flight samples for `seq`
        (input_from_last_sample), `num_generated` tokens into its output."""
        # Its output lacks the sample in flight: only one-token bad words reach here (step_scheduler.py
        # plans no sequence with a longer one ahead), and their bans read nothing of the output.
        bad_words = seq.sampling.bad_words
        self.ahead.append(SequenceStep(
            seq_id=seq.seq_id, token_ids=(), start_position=start, new_blocks=new_blocks,
            reset_block_table=False, sample=True, sampling=seq.sampling, num_generated=num_generated,
            input_from_last_sample=True, banned_token_ids=bad_words.always if bad_words is not None else (),
        ))
        self.token_budget -= 1
        self._service.charge(seq.tenant, num_decode_tokens=1)

    def decode_end(self, seq: Sequence) -> int:
        """The positions `seq` covers once its next decode is computed."""
        after = self.in_flight_samples.get(seq.seq_id)
        return (seq.num_computed_tokens if after is None else after[0]) + 1

    def pick_decode(self, seq: Sequence, new_blocks: tuple[int, ...]) -> None:
        """`seq`'s next decode: of the token a step in flight samples for it, else of its last token."""
        after = self.in_flight_samples.get(seq.seq_id)
        if after is None:
            self.pick(seq, 1, new_blocks)
        else:
            self.pick_ahead(seq, after[0], after[1], new_blocks)

    def _bill(self, seq: Sequence, num_new_tokens: int) -> None:
        """Charges the tenant when service is given, so later picks in this step already see it:
        prompt tokens computed for the first time, and the token sampled at the end."""
        end = self.start_of(seq) + num_new_tokens
        num_prompt_tokens = len(seq.prompt_token_ids)
        if seq.num_billed_prompt_tokens == num_prompt_tokens:  # a decode: the whole prompt billed before
            self._service.charge(seq.tenant, num_decode_tokens=int(end == seq.num_tokens))
            return
        num_prompt = min(end, num_prompt_tokens) - seq.num_billed_prompt_tokens
        seq.num_billed_prompt_tokens += max(0, num_prompt)
        self._service.charge(seq.tenant, num_prefill_tokens=max(0, num_prompt),
                             num_decode_tokens=int(end == seq.num_tokens))

    def unpick(self, seq: Sequence) -> None:
        picked = self.picked.pop(seq.seq_id, None)
        if picked is not None:
            self.token_budget += picked[1]

    def build_steps(self) -> tuple[SequenceStep, ...]:
        steps = []
        ends = self.in_flight_ends
        for seq, num_new, new_blocks in self.picked.values():
            start = ends.get(seq.seq_id, seq.num_computed_tokens) if ends else seq.num_computed_tokens
            end = start + num_new
            reset = seq.needs_block_table_reset
            sample = end == seq.num_tokens
            sampling = seq.sampling
            bad_words = sampling.bad_words
            step = SequenceStep(
                seq_id=seq.seq_id,
                token_ids=seq.token_ids(start, end),
                start_position=start,
                new_blocks=new_blocks,
                reset_block_table=reset,
                sample=sample,
                sampling=sampling,
                num_generated=len(seq.output_token_ids),
                # A reset table's tokens before `start` are reused cached blocks (0 without a hit).
                num_cached_tokens=start if reset else 0,
                context_token_ids=seq.token_ids(0, start) if reset and start and sampling.needs_history else (),
                banned_token_ids=bad_words.banned(seq.output_token_ids) if bad_words is not None and sample
                else (),
            )
            if sampling.prompt_logprobs is not None:
                _add_prompt_logprobs(step, seq, end)
            steps.append(step)
            seq.needs_block_table_reset = False
        return (*self.ahead, *steps)


def _add_prompt_logprobs(step: SequenceStep, seq: Sequence, end: int) -> None:
    """A prompt chunk's prompt_logprobs fields, while the sequence's are missing (none otherwise)."""
    num_prompt = seq.num_prompt_tokens
    if seq.needs_prompt_logprobs and end <= num_prompt:
        step.prompt_logprobs = seq.sampling.prompt_logprobs
        step.next_prompt_token_id = seq.prompt_token_ids[end] if end < num_prompt else None
