"""What the step scheduler hands a worker for one iteration, and what it hands back to clients.

`StepPlan` maps 1:1 onto infermesh.v1.RunStep and `SequenceStep` onto
infermesh.v1.SequenceStep (trace_context is added by the servicer, which owns
the per-request trace). `SequenceDelta` is one chunk of a Generate stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.logprobs import PositionLogprobs
from services.scheduler.sequence import AbortReason, FinishReason, SamplingParams


# Not frozen, though never changed once handed on: one is built per token, and a frozen dataclass's
# __init__ costs ~3x (an object.__setattr__ per field; bench.scheduler.bench_step_cpu 18 -> 14 us a token).
@dataclass(slots=True)
class SequenceStep:
    seq_id: int
    # Tokens to compute: a prompt chunk, recomputed tokens after preemption, or the last sampled token
    # (empty with input_from_last_sample).
    token_ids: tuple[int, ...]
    # Position of token_ids[0] in the sequence (= tokens whose KV the worker already holds).
    start_position: int
    # Physical KV blocks appended to the sequence's block table by this step, in order.
    new_blocks: tuple[int, ...]
    # Drop the worker's block table before appending new_blocks (first step, after preemption).
    reset_block_table: bool
    # Sample a next token after the last of token_ids (false for non-final prefill chunks).
    sample: bool
    sampling: SamplingParams
    # Tokens generated so far, so seeded sampling is reproducible across preemption.
    num_generated: int
    # With reset_block_table: positions [0, num_cached_tokens) of the new table already hold this
    # sequence's KV (full blocks reused from the prefix cache), so start_position may be up to it.
    num_cached_tokens: int = 0
    # The one token to compute is the one the worker samples for this sequence in the step before,
    # still in flight when this one was planned (a pipelined decode); token_ids is empty.
    input_from_last_sample: bool = False
    # With reset_block_table and penalized sampling: the tokens at [0, start_position), which the step
    # does not compute (a cached prefix), so the worker holds every token the penalties count.
    context_token_ids: tuple[int, ...] = ()
    # A prompt chunk of a request that asked for prompt logprobs: the worker reports those of the
    # prompt tokens it predicts (token_ids[1:], then next_prompt_token_id) with this many alternatives.
    prompt_logprobs: int | None = None
    # With prompt_logprobs, a chunk ending before the prompt does: the prompt token after it.
    next_prompt_token_id: int | None = None
    # With sample and sampling.bad_words: the ids this sample must not be after the output so far
    # (min_tokens' bans are added where the step is encoded, from num_generated).
    banned_token_ids: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        """Tokens the step computes for the sequence."""
        return 1 if self.input_from_last_sample else len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    seqs: tuple[SequenceStep, ...]
    # Sequences finished, aborted or preempted since the last plan: the worker forgets
    # their block tables before running `seqs`. Never also in `seqs`.
    finished_seq_ids: tuple[int, ...]
    # Scheduler side only (not sent): sequences aborted because their deadline passed;
    # the servicer ends their streams with DEADLINE_EXCEEDED.
    expired_seq_ids: tuple[int, ...] = ()
    # Scheduler side only: sequences preempted by this plan (a subset of finished_seq_ids), for metrics.
    preempted_seq_ids: tuple[int, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def has_work(self) -> bool:
        """Whether the worker must run this plan (otherwise only `finished_seq_ids` may need sending)."""
        return bool(self.seqs)


# Not frozen: one is built per token (why: step_plan.SequenceStep).
@dataclass(slots=True)
class SequenceDelta:
    """New output of one sequence after a step: stream it as one GenerateResponse chunk."""

    seq_id: int
    token_ids: tuple[int, ...]
    # UTF-8 text of token_ids, continuing held-back bytes; stop strings never appear.
    text: str
    # Position in the streamed output of token_ids[0].
    index: int
    # Set when the sequence finished normally with this chunk.
    finish_reason: FinishReason | None = None
    # Set when the sequence was aborted (e.g. its worker sent no token); end the stream with an error.
    abort_reason: AbortReason | None = None
    num_prompt_tokens: int = 0
    # Tokens generated in total (usage.completion_tokens), counting an end-of-sequence token
    # that is not streamed.
    num_generated: int = 0
    # With sampling.logprobs: one per token_ids entry (None where the worker sent none).
    logprobs: tuple[PositionLogprobs | None, ...] = ()
    # With sampling.prompt_logprobs, on the stream's first chunk: the prompt's tokens and one entry
    # per prompt token (None for the first, and where the worker sent none).
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[PositionLogprobs | None, ...] = ()
    # On the last chunk of a sequence that ended on an end-of-sequence or stop token id: that token.
    end_token_id: int | None = None
    # With sampling.embed, on its only chunk: the pooled vector the worker returned.
    embedding: tuple[float, ...] = ()

    @property
    def is_last(self) -> bool:
        return self.finish_reason is not None or self.abort_reason is not None
