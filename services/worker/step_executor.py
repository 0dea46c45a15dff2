"""Runs one continuous-batching step over the worker's paged KV cache.

The scheduler owns block allocation; the worker keeps a mirror of each
sequence's block table (appending `new_blocks`, dropping it on
`reset_block_table` or when the sequence is finished) and how many of its
positions hold valid KV. A sequence whose step is inconsistent with that
mirror — unknown blocks, positions past its table, a gap before its first new
token — fails alone with INVALID_ARGUMENT and is forgotten; the others run.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.worker.models.generator import Generator
from services.worker.models.paged import PagedSequence
from services.worker.sampling import check_sampling, sample_token
from services.worker.work import ErrorCode, ItemError, RunStep, SequenceOutput, SequenceStep, StageDurations

Clock = Callable[[], float]


@dataclass
class _SequenceState:
    block_table: list[int]
    num_cached: int  # positions 0..num_cached-1 hold this sequence's KV
    seed: int  # used when the request brought none


class StepExecutor:
    def __init__(
        self,
        generator: Generator,
        num_kv_blocks: int,
        block_size: int,
        clock: Clock = time.perf_counter,
        seed_source: Callable[[], int] | None = None,
    ) -> None:
        self.generator = generator
        self.cache = generator.new_kv_cache(num_kv_blocks, block_size)
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.clock = clock
        self._seed_source = seed_source or (lambda: random.SystemRandom().getrandbits(64))
        self._seqs: dict[int, _SequenceState] = {}

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

    def run(self, step: RunStep) -> tuple[list[SequenceOutput], StageDurations]:
        """One output per sequence of the step, in order, and the step's stage durations."""
        self.forget(step.finished_seq_ids)
        outputs: dict[int, SequenceOutput] = {}
        admitted: list[tuple[int, SequenceStep, PagedSequence]] = []
        seen: set[int] = set()
        for pos, seq in enumerate(step.seqs):
            if seq.seq_id in seen:
                # Only the repeat fails; the first occurrence already owns the sequence's state.
                message = f"sequence {seq.seq_id} appears twice in step {step.step_id}"
                outputs[pos] = SequenceOutput(seq.seq_id, error=ItemError(ErrorCode.INVALID_ARGUMENT, message))
                continue
            seen.add(seq.seq_id)
            try:
                admitted.append((pos, seq, self._admit(seq)))
            except InvalidArgument as exc:
                outputs[pos] = SequenceOutput(seq.seq_id, error=ItemError(ErrorCode.INVALID_ARGUMENT, exc.message))
                self._seqs.pop(seq.seq_id, None)  # the scheduler aborts a failed sequence

        t_start = self.clock()
        logits = self.generator.step([paged for _, _, paged in admitted], self.cache) if admitted else None
        t_computed = self.clock()

        row = 0
        for pos, seq, paged in admitted:
            state = self._seqs[seq.seq_id]
            state.num_cached = paged.end_position
            if not seq.sample:
                outputs[pos] = SequenceOutput(seq.seq_id)
                continue
            seed = seq.sampling.seed if seq.sampling.seed is not None else state.seed
            token, logprob = sample_token(logits[row].numpy(), seq.sampling, seed=seed, index=seq.num_generated)
            outputs[pos] = SequenceOutput(seq.seq_id, token_id=token, logprob=logprob)
            row += 1
        t_done = self.clock()
        return [outputs[pos] for pos in range(len(step.seqs))], StageDurations(
            compute_s=t_computed - t_start, postprocess_s=t_done - t_computed
        )

    def _admit(self, seq: SequenceStep) -> PagedSequence:
        """Validates the step against the mirror, then updates the mirror; InvalidArgument leaves it untouched."""
        g = self.generator
        n = len(seq.token_ids)
        if n == 0:
            raise InvalidArgument(f"sequence {seq.seq_id}: no token_ids to compute")
        bad_tokens = [t for t in seq.token_ids if not 0 <= t < g.vocab_size]
        if bad_tokens:
            raise InvalidArgument(f"sequence {seq.seq_id}: token ids {bad_tokens[:5]} outside [0, {g.vocab_size})")
        if seq.start_position < 0 or seq.start_position + n > g.max_seq_len:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: positions {seq.start_position}..{seq.start_position + n - 1} "
                f"outside [0, max_seq_len {g.max_seq_len})"
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

        known = self._seqs.get(seq.seq_id)
        fresh = seq.reset_block_table or known is None
        table = list(seq.new_blocks) if fresh else known.block_table + list(seq.new_blocks)
        num_cached = 0 if fresh else known.num_cached
        if seq.start_position > num_cached:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: start_position {seq.start_position} but only {num_cached} positions are "
                f"cached on this worker" + (" (unknown sequence: send reset_block_table)" if known is None else "")
            )
        end = seq.start_position + n
        if len(table) * self.block_size < end:
            raise InvalidArgument(
                f"sequence {seq.seq_id}: block table of {len(table)} blocks holds {len(table) * self.block_size} "
                f"positions; this step needs {end}"
            )
        if fresh:
            self._seqs[seq.seq_id] = _SequenceState(table, 0, known.seed if known else self._seed_source())
        else:
            known.block_table = table
        return PagedSequence(tuple(seq.token_ids), seq.start_position, tuple(table), needs_logits=seq.sample)
