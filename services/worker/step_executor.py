"""Runs one continuous-batching step over the worker's paged KV cache.

The step is checked and mirrored by `SequenceMirror` (the Attach contract: block
tables, cached positions, a failing sequence fails alone); the admitted sequences
then run through the model in one call and the sampled ones get a token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np

from services.common.clock import Clock
from services.common.logprobs import PositionLogprobs
from services.worker.grammar import GrammarError, GrammarTokenizer, Guide
from services.worker.models.generator import Generator
from services.worker.models.paged import PagedSequence
from services.worker.prompt_logprobs import chunk_targets, prompt_logprobs
from services.worker.sampling import processed_logits, sample
from services.worker.sequence_mirror import AdmittedSequence, SequenceMirror
from services.worker.work import ErrorCode, ItemError, RunStep, SequenceOutput, StageDurations


class StepExecutor:
    def __init__(
        self,
        generator: Generator,
        num_kv_blocks: int,
        block_size: int,
        clock: Clock = time.perf_counter,
        seed_source: Callable[[], int] | None = None,
        grammar_tokenizer: GrammarTokenizer | None = None,
    ) -> None:
        """`grammar_tokenizer`: the model's tokenizer for constrained sampling (None: refused per sequence)."""
        self.generator = generator
        self.grammar_tokenizer = grammar_tokenizer
        self.cache = generator.new_kv_cache(num_kv_blocks, block_size)
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.clock = clock
        self._mirror = SequenceMirror(num_kv_blocks, block_size, generator.vocab_size, generator.max_seq_len,
                                      seed_source)

    def _allowed(self, admitted: AdmittedSequence) -> np.ndarray:
        """The ids the sequence's grammar allows next; its matcher made here on first use (or after a reset)."""
        seq = admitted.step
        guide = self._mirror.guide(seq.seq_id)
        if guide is None or guide.grammar != seq.sampling.grammar:
            if self.grammar_tokenizer is None:
                raise GrammarError("this worker's model has no tokenizer to constrain its output with")
            guide = Guide(self.grammar_tokenizer, seq.sampling.grammar)
            self._mirror.set_guide(seq.seq_id, guide)
        history = admitted.token_ids
        return guide.allowed(history[len(history) - seq.num_generated :])

    @property
    def num_sequences(self) -> int:
        return self._mirror.num_sequences

    @property
    def num_kv_blocks_used(self) -> int:
        return self._mirror.num_kv_blocks_used

    def block_table(self, seq_id: int) -> tuple[int, ...]:
        return self._mirror.block_table(seq_id)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop block-table mirrors (finished, aborted or preempted sequences); unknown ids are ignored."""
        self._mirror.forget(seq_ids)

    def forget_all(self) -> None:
        """The scheduler session ended: no block table is used again."""
        self._mirror.forget_all()

    def run(self, step: RunStep) -> tuple[list[SequenceOutput], StageDurations]:
        """One output per sequence of the step, in order, and the step's stage durations."""
        admission = self._mirror.admit_step(step)
        outputs = dict(admission.refused)
        paged = [PagedSequence(tuple(a.step.token_ids), a.step.start_position, a.block_table,
                               needs_logits=a.step.sample, all_logits=a.step.prompt_logprobs is not None)
                 for a in admission.admitted]

        t_start = self.clock()
        # One device-to-host copy per step (sampling runs on the host); it also waits for the GPU,
        # so compute_s covers the device work, not only its launch.
        logits = self.generator.step(paged, self.cache).cpu() if paged else None
        t_computed = self.clock()

        row = 0
        for admitted in admission.admitted:
            seq = admitted.step
            prompt: tuple[PositionLogprobs, ...] = ()
            if seq.prompt_logprobs is not None:
                assert logits is not None  # the sequence is in the step, so the step ran
                targets = chunk_targets(seq.token_ids, seq.next_prompt_token_id)
                prompt = prompt_logprobs(logits[row:row + len(targets)], targets, seq.prompt_logprobs)
                row += len(seq.token_ids) - 1  # the last row: the sample's, or the next chunk's token's
                if not seq.sample:
                    row += 1
            if not seq.sample:
                self._mirror.computed(admitted)
                outputs[admitted.index] = SequenceOutput(seq.seq_id, prompt_logprobs=prompt)
                continue
            assert logits is not None  # a sampling sequence means the step ran (paged is non-empty)
            row_logits = logits[row].numpy()
            row += 1
            if seq.sampling.penalized or seq.sampling.logit_bias or seq.sampling.grammar:
                row_logits = processed_logits(row_logits, seq.sampling, admitted.token_ids, seq.num_generated)
            if seq.sampling.grammar:
                try:
                    row_logits[~self._allowed(admitted)] = -np.inf
                except GrammarError as exc:
                    self._mirror.forget([seq.seq_id])  # the scheduler aborts a failed sequence
                    outputs[admitted.index] = SequenceOutput(seq.seq_id, error=ItemError(
                        ErrorCode.INVALID_ARGUMENT, f"sequence {seq.seq_id}: {exc}"))
                    continue
            drawn = sample(row_logits, seq.sampling, seed=admitted.seed, index=seq.num_generated)
            self._mirror.computed(admitted, drawn.token_id)
            outputs[admitted.index] = SequenceOutput(seq.seq_id, token_id=drawn.token_id, logprob=drawn.logprob,
                                                     logprobs=drawn.logprobs, prompt_logprobs=prompt)
        t_done = self.clock()
        return [outputs[pos] for pos in range(len(step.seqs))], StageDurations(
            compute_s=t_computed - t_start, postprocess_s=t_done - t_computed
        )
