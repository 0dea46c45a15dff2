"""The worker's mirror of the scheduler's block tables: the Attach contract for one step.

The scheduler owns block allocation; the worker keeps a mirror of each
sequence's block table (appending `new_blocks`, dropping it on
`reset_block_table` or when the sequence is finished) and how many of its
positions hold valid KV. A sequence whose step is inconsistent with that
mirror — unknown blocks, positions past its table, a gap before its first new
token — fails alone with INVALID_ARGUMENT and is forgotten; the others run.

Pipelined steps: the mirror keeps each sequence's last sampled token, so a step sent before the
previous step's result (`input_from_last_sample`, no token ids) computes that token; a sequence
whose previous step sampled nothing here fails alone with INVALID_ARGUMENT. Steps are admitted in
the order sent, so two in flight see each other's effects as if sent one at a time.

Prefix cache: a reset table may start with `num_cached_tokens` positions whose KV
other sequences computed into the same pages (the scheduler's cache says which);
the worker keeps every page as it is until the scheduler has it overwritten, so
those positions count as cached and the step computes only from there.

Shared by every generator runtime (the model's StepExecutor, the mock), so they
accept and refuse exactly the same steps. No torch, no grpc.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidArgument
from services.common.grammar_after_reasoning import GrammarAfterReasoning, GrammarScan
from services.common.logprobs import MAX_TOP_LOGPROBS
from services.worker.sampling import check_sampling
from services.worker.work import ErrorCode, ItemError, RunStep, SequenceOutput, SequenceStep

# What the worker declares as WorkerCapacity.max_steps_in_flight: the scheduler may send the next
# steps before this one's result, their decodes taking their input from the last sample (the mirror
# keeps one per sequence, and steps run in the order sent, so any depth works).
MAX_STEPS_IN_FLIGHT = 16
# WorkerCapacity.max_steps_per_command: steps the worker takes in one RunSteps command.
MAX_STEPS_PER_COMMAND = 8


@dataclass
class _SequenceState:
    block_table: list[int]
    num_cached: int  # positions 0..num_cached-1 hold this sequence's KV
    seed: int  # used when the request brought none
    last_sample: int | None = None  # the token sampled by the last step that ran it; None: it sampled none
    # Penalized or constrained sampling only: every token of the sequence at [0, end of its last step).
    token_ids: list[int] | None = None
    # Constrained sampling: the sequence's grammar matcher (services/worker/grammar.py), made by the
    # step executor; a reset table starts without one, so it is rebuilt from the tokens.
    guide: Any = None
    # A grammar that waits for the reasoning: where it starts in the output, likewise found again
    # from the tokens after a reset.
    grammar_scan: GrammarScan | None = None


@dataclass(frozen=True)
class AdmittedSequence:
    index: int  # position of the sequence in the step
    step: SequenceStep
    block_table: tuple[int, ...]  # the whole table after this step's new blocks
    seed: int  # the request's seed, else the one this worker drew for the sequence
    # Penalized sampling only: the sequence's tokens up to end_position (the mirror's list: read, never kept).
    token_ids: Sequence[int] = ()

    @property
    def end_position(self) -> int:
        return self.step.start_position + len(self.step.token_ids)


@dataclass(frozen=True)
class StepAdmission:
    admitted: tuple[AdmittedSequence, ...]  # in step order
    refused: dict[int, SequenceOutput]  # index in the step -> its INVALID_ARGUMENT output


class SequenceMirror:
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        vocab_size: int,
        max_seq_len: int,
        seed_source: Callable[[], int] | None = None,
    ) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self._seed_source = seed_source or (lambda: random.SystemRandom().getrandbits(64))
        self._seqs: dict[int, _SequenceState] = {}
        # The LoRA adapters the model serves (StepExecutor sets them): a sequence naming another fails alone.
        self.lora_adapters: frozenset[str] = frozenset()

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_kv_blocks_used(self) -> int:
        return len({b for s in self._seqs.values() for b in s.block_table})

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self._seqs[seq_id].block_table)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop block-table mirrors (finished, aborted or preempted sequences); unknown ids are ignored."""
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def forget_all(self) -> None:
        self._seqs.clear()

    def admit_step(self, step: RunStep) -> StepAdmission:
        """Forgets the step's finished sequences, then checks and mirrors each sequence of the step."""
        self.forget(step.finished_seq_ids)
        admitted: list[AdmittedSequence] = []
        refused: dict[int, SequenceOutput] = {}
        seen: set[int] = set()
        for index, seq in enumerate(step.seqs):
            if seq.seq_id in seen:
                # Only the repeat fails; the first occurrence already owns the sequence's state.
                message = f"sequence {seq.seq_id} appears twice in step {step.step_id}"
                refused[index] = SequenceOutput(seq.seq_id, error=ItemError(ErrorCode.INVALID_ARGUMENT, message))
                continue
            seen.add(seq.seq_id)
            try:
                admitted.append(self._admit(index, seq))
            except InvalidArgument as exc:
                refused[index] = SequenceOutput(seq.seq_id, error=ItemError(ErrorCode.INVALID_ARGUMENT, exc.message))
                self._seqs.pop(seq.seq_id, None)  # the scheduler aborts a failed sequence
        return StepAdmission(tuple(admitted), refused)

    def guide(self, seq_id: int) -> Any:
        """The sequence's grammar matcher as set_guide() left it (None: none yet)."""
        return self._seqs[seq_id].guide

    def set_guide(self, seq_id: int, guide: Any) -> None:
        self._seqs[seq_id].guide = guide

    def grammar_scan(self, seq_id: int, after: GrammarAfterReasoning) -> GrammarScan:
        """The sequence's scan for where its grammar starts after the reasoning (a new one for a reset
        table, or for another `after`)."""
        state = self._seqs[seq_id]
        if state.grammar_scan is None or state.grammar_scan.after != after:
            state.grammar_scan = GrammarScan(after)
        return state.grammar_scan

    def computed(self, sequence: AdmittedSequence, sampled_token: int | None = None) -> None:
        """The step ran: the sequence's KV now covers every position up to its last new token, and
        `sampled_token` (None: it sampled none) is what a next `input_from_last_sample` step computes."""
        state = self._seqs[sequence.step.seq_id]
        state.num_cached = sequence.end_position
        state.last_sample = sampled_token

    def _admit(self, index: int, seq: SequenceStep) -> AdmittedSequence:
        """Validates the step against the mirror, then updates the mirror; InvalidArgument leaves it untouched."""
        known = self._seqs.get(seq.seq_id)
        if seq.input_from_last_sample:
            seq = self._with_last_sample(seq, known)
        self._check_alone(seq)
        kept = None if seq.reset_block_table else known  # the mirror this step extends; None: a fresh table
        table = list(seq.new_blocks) if kept is None else kept.block_table + list(seq.new_blocks)
        num_cached = seq.num_cached_tokens if kept is None else kept.num_cached
        if seq.num_cached_tokens and kept is not None:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: num_cached_tokens {seq.num_cached_tokens} without reset_block_table"
            )
        if num_cached > len(table) * self.block_size:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: num_cached_tokens {num_cached} but the new block table of {len(table)} "
                f"blocks holds {len(table) * self.block_size} positions"
            )
        if seq.start_position > num_cached:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: start_position {seq.start_position} but only {num_cached} positions are "
                f"cached on this worker" + (" (unknown sequence: send reset_block_table)" if known is None else "")
            )
        end = seq.start_position + len(seq.token_ids)
        if len(table) * self.block_size < end:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: block table of {len(table)} blocks holds {len(table) * self.block_size} "
                f"positions; this step needs {end}"
            )
        history = self._history(seq, kept)
        if kept is None:
            state = _SequenceState(table, num_cached, known.seed if known else self._seed_source())
            self._seqs[seq.seq_id] = state
        else:
            state = kept
            state.block_table = table
        state.token_ids = history
        seed = seq.sampling.seed if seq.sampling.seed is not None else state.seed
        return AdmittedSequence(index, seq, tuple(table), seed, history if history is not None else ())

    @staticmethod
    def _history(seq: SequenceStep, kept: _SequenceState | None) -> list[int] | None:
        """The sequence's tokens through this step, when its sampling is penalized (else None): a fresh
        table's context_token_ids and token ids, or the kept list with this step's tokens in place."""
        if not seq.sampling.needs_history:
            return None
        if kept is None:
            if len(seq.context_token_ids) != seq.start_position:
                raise InvalidArgument(
                    f"sequence {seq.seq_id}: penalized or constrained sampling needs the {seq.start_position} tokens before "
                    f"start_position in context_token_ids, got {len(seq.context_token_ids)}"
                )
            return [*seq.context_token_ids, *seq.token_ids]
        if kept.token_ids is None or len(kept.token_ids) < seq.start_position:
            raise InvalidArgument(f"sequence {seq.seq_id}: penalized or constrained sampling, but this worker does not hold the "
                                  f"tokens before position {seq.start_position} (send reset_block_table)")
        history = kept.token_ids
        del history[seq.start_position :]
        history.extend(seq.token_ids)
        return history

    @staticmethod
    def _with_last_sample(seq: SequenceStep, known: _SequenceState | None) -> SequenceStep:
        """The step with the token it asks for filled in (the admitted step carries it, so runtimes see
        ordinary token ids)."""
        if seq.token_ids or seq.reset_block_table:
            raise InvalidArgument(f"sequence {seq.seq_id}: input_from_last_sample with "
                                  f"{'token_ids' if seq.token_ids else 'reset_block_table'}")
        if known is None or known.last_sample is None:
            raise InvalidArgument(f"sequence {seq.seq_id}: input_from_last_sample, but this worker sampled no "
                                  f"token for it in its previous step")
        return dataclasses.replace(seq, token_ids=(known.last_sample,))

    def _check_alone(self, seq: SequenceStep) -> None:
        """What can be checked without the mirror: token ids, positions, block ids, sampling."""
        n = len(seq.token_ids)
        if n == 0:
            raise InvalidArgument(f"sequence {seq.seq_id}: no token_ids to compute")
        if seq.lora_adapter and seq.lora_adapter not in self.lora_adapters:
            raise InvalidArgument(f"sequence {seq.seq_id}: lora_adapter {seq.lora_adapter!r} is not served by "
                                  "this worker")
        bad_tokens = [t for t in seq.token_ids if not 0 <= t < self.vocab_size]
        if bad_tokens:
            raise InvalidArgument(f"sequence {seq.seq_id}: token ids {bad_tokens[:5]} outside [0, {self.vocab_size})")
        if seq.start_position < 0 or seq.start_position + n > self.max_seq_len:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: positions {seq.start_position}..{seq.start_position + n - 1} "
                f"outside [0, max_seq_len {self.max_seq_len})"
            )
        bad_blocks = [b for b in seq.new_blocks if not 0 <= b < self.num_kv_blocks]
        if bad_blocks:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: block ids {bad_blocks[:5]} outside the worker's {self.num_kv_blocks} blocks"
            )
        if seq.sample:
            try:
                check_sampling(seq.sampling)
            except ValueError as exc:
                raise InvalidArgument(f"sequence {seq.seq_id}: {exc}") from None
            if seq.num_generated < 0:
                raise InvalidArgument(f"sequence {seq.seq_id}: num_generated must be >= 0, got {seq.num_generated}")
            bad_bias = [t for t, _ in seq.sampling.logit_bias if not 0 <= t < self.vocab_size]
            if bad_bias:
                raise InvalidArgument(f"sequence {seq.seq_id}: logit_bias token ids {bad_bias[:5]} outside "
                                      f"[0, {self.vocab_size})")
            bad_allowed = [t for t in seq.sampling.allowed_token_ids if not 0 <= t < self.vocab_size]
            if bad_allowed:
                raise InvalidArgument(f"sequence {seq.seq_id}: allowed token ids {bad_allowed[:5]} outside "
                                      f"[0, {self.vocab_size})")
            bad_bans = [t for t in seq.banned_token_ids if not 0 <= t < self.vocab_size]
            if bad_bans:
                raise InvalidArgument(f"sequence {seq.seq_id}: banned token ids {bad_bans[:5]} outside "
                                      f"[0, {self.vocab_size})")
            self._check_grammar_after(seq)
        if seq.prompt_logprobs is not None:
            self._check_prompt_logprobs(seq)
        bad_context = [t for t in seq.context_token_ids if not 0 <= t < self.vocab_size]
        if bad_context:
            raise InvalidArgument(f"sequence {seq.seq_id}: context token ids {bad_context[:5]} outside "
                                  f"[0, {self.vocab_size})")

    def _check_grammar_after(self, seq: SequenceStep) -> None:
        after = seq.sampling.grammar_after_reasoning
        if after is None:
            return
        tags = (after.end_token_id,) if after.start_token_id is None else (after.end_token_id, after.start_token_id)
        if not seq.sampling.grammar or not all(0 <= t < self.vocab_size for t in tags):
            raise InvalidArgument(f"sequence {seq.seq_id}: grammar_after_reasoning needs a grammar and token ids "
                                  f"in [0, {self.vocab_size}), got {list(tags)}")

    def _check_prompt_logprobs(self, seq: SequenceStep) -> None:
        assert seq.prompt_logprobs is not None
        if not 0 <= seq.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"sequence {seq.seq_id}: prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                                  f"got {seq.prompt_logprobs}")
        following = seq.next_prompt_token_id
        if following is not None and not (0 <= following < self.vocab_size and not seq.sample):
            raise InvalidArgument(f"sequence {seq.seq_id}: next_prompt_token_id {following} must be a token id "
                                  f"below {self.vocab_size}, on a chunk that does not sample")
