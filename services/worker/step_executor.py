"""Runs one continuous-batching step over the worker's paged KV cache.

The step is checked and mirrored by `SequenceMirror` (the Attach contract: block
tables, cached positions, a failing sequence fails alone); the admitted sequences
then run through the model in one call and the sampled ones get a token. The
constrained ones' grammar masks are computed while the model runs
(services/worker/step_masks.py) and applied to their rows at once after it.
A plain decode step replays a CUDA graph when the executor has them
(services/worker/decode_graph_steps.py); any other step runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future

import numpy as np
import torch

from services.common.clock import Clock
from services.common.logprobs import PositionLogprobs
from services.worker.decode_graph_steps import DecodeGraphRunner, StepPath, step_path
from services.worker.grammar import GrammarError, GrammarTokenizer
from services.worker.models.generator import Generator
from services.worker.models.paged import KVCache, PagedSequence
from services.worker.pooling import PooledSequence, PoolingSpec
from services.worker.prompt_logprobs import chunk_targets, prompt_logprobs
from services.worker.sampling import only_allowed, processed_logits, sample, without_banned
from services.worker.sequence_mirror import AdmittedSequence, SequenceMirror
from services.worker.step_masks import MaskJob, StepMasker, StepMasks, mask_logits
from services.worker.work import ErrorCode, ItemError, RunStep, SequenceOutput, StageDurations

log = logging.getLogger(__name__)


class StepExecutor:
    def __init__(
        self,
        generator: Generator,
        num_kv_blocks: int,
        block_size: int,
        clock: Clock = time.perf_counter,
        seed_source: Callable[[], int] | None = None,
        grammar_tokenizer: GrammarTokenizer | None = None,
        pooling: PoolingSpec | None = None,
    ) -> None:
        """`grammar_tokenizer`: the model's tokenizer for constrained sampling (None: refused per sequence).
        `pooling`: an embedding model's; every step then pools (`_run_pooled`) and nothing is sampled."""
        self.generator = generator
        self._cache = generator.new_kv_cache(num_kv_blocks, block_size)
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.clock = clock
        self._mirror = SequenceMirror(num_kv_blocks, block_size, generator.vocab_size, generator.max_seq_len,
                                      seed_source)
        if generator.lora is not None:
            self._mirror.lora_adapters = frozenset(generator.lora.names)
        self._masker: StepMasker | None = None
        self.grammar_tokenizer = grammar_tokenizer
        # Captured over self.cache (use_decode_graphs); None: every step runs eagerly.
        self._decode_graphs: DecodeGraphRunner | None = None
        self.num_steps_by_path = dict.fromkeys(StepPath, 0)
        self._pooling = pooling
        self._pooled: dict[int, PooledSequence] = {}  # by seq_id: the prompts being pooled

    @property
    def cache(self) -> KVCache:
        """The worker's KV pages, allocated once: decode graphs hold its tensors' addresses, so it has
        no setter and nothing resizes it."""
        return self._cache

    @property
    def decode_graphs(self) -> DecodeGraphRunner | None:
        return self._decode_graphs

    def use_decode_graphs(self, graphs: DecodeGraphRunner | None) -> None:
        """Plain decode steps replay `graphs` from now on (captured over `self.cache`); None: none do."""
        self._decode_graphs = graphs

    def _forward(self, paged: Sequence[PagedSequence]) -> torch.Tensor:
        """The step's logits, one row per logit row of `paged` in order: a graph replay when the graphs
        take the step, else the eager step. A replay that raises turns the graphs off for good (the
        eager step then computes this one: it rewrites the same slots with the same keys and values)."""
        graphs = self._decode_graphs
        if graphs is not None and self.generator.lora is not None and any(s.adapter for s in paged):
            graphs = None  # the graphs were captured over the base model: LoRA rows run eagerly
        if graphs is not None and step_path(paged, graphs) is StepPath.GRAPH:
            try:
                logits = graphs.run(paged, checked=True)  # step_path has just asked graphs.refusal
                self.num_steps_by_path[StepPath.GRAPH] += 1
                return logits
            except Exception as error:
                log.warning("CUDA graphs off from now on, every step runs eagerly: a replay of %d sequences "
                            "failed: %s: %s", len(paged), type(error).__name__, error)
                self._decode_graphs = None
        self.num_steps_by_path[StepPath.EAGER] += 1
        return self.generator.step(paged, self._cache)

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer | None:
        return self._masker.tokenizer if self._masker is not None else None

    @grammar_tokenizer.setter
    def grammar_tokenizer(self, tokenizer: GrammarTokenizer | None) -> None:
        if self._masker is not None:
            self._masker.close()
        self._masker = StepMasker(tokenizer) if tokenizer is not None else None

    def _grammar_starts(self, admitted: Sequence[AdmittedSequence]) -> dict[int, int]:
        """The constrained sequences of the step, by position: those that sample now under their
        grammar, each with how many of its output tokens come before the grammar's first (0 unless
        the grammar waited for a think block). One still thinking is not among them: it samples as
        an unconstrained one does, and starts no mask job."""
        starts: dict[int, int] = {}
        for position, a in enumerate(admitted):
            if a.step.sample and a.step.sampling.grammar:
                start = self._grammar_start(a)
                if start is not None:
                    starts[position] = start
        return starts

    def _grammar_start(self, admitted: AdmittedSequence) -> int | None:
        after = admitted.step.sampling.grammar_after_reasoning
        if after is None:
            return 0
        scan = self._mirror.grammar_scan(admitted.step.seq_id, after)
        return scan.grammar_start(admitted.token_ids, admitted.step.num_generated)

    def _mask_job(self, admitted: AdmittedSequence, grammar_start: int) -> MaskJob:
        """What the mask thread needs for the sequence: its guide (None: make one), the output tokens
        from `grammar_start` on that the guide has not consumed (the mirror's list is read here, never
        on the thread), and the block's opening where it may come first."""
        seq = admitted.step
        guide = self._mirror.guide(seq.seq_id)
        if guide is not None and guide.grammar != seq.sampling.grammar:
            guide = None
        held_start = len(admitted.token_ids) - seq.num_generated + grammar_start
        consumed = guide.num_consumed if guide is not None else 0
        after = seq.sampling.grammar_after_reasoning
        return MaskJob(seq.sampling.grammar, guide, admitted.token_ids[held_start + consumed :],
                       after.also_allowed(seq.num_generated) if after is not None else None)

    def _start_masks(self, constrained: Sequence[AdmittedSequence],
                     grammar_starts: Sequence[int]) -> Future[StepMasks] | None:
        if not constrained or self._masker is None:
            return None
        return self._masker.start([self._mask_job(a, s) for a, s in zip(constrained, grammar_starts, strict=True)])

    def _take_masks(self, constrained: Sequence[AdmittedSequence], masks: StepMasks | None,
                    logits: np.ndarray, rows: Sequence[int]) -> dict[int, GrammarError]:
        """Masks the constrained sequences' sample rows of `logits` (all at once) and keeps their
        guides; the errors of those that failed, by sequence id (they fail alone)."""
        if masks is None:  # constrained sequences on a worker without a tokenizer
            error = GrammarError("this worker's model has no tokenizer to constrain its output with")
            return {a.step.seq_id: error for a in constrained}
        mask_logits(logits, rows, masks.bitmask)
        errors: dict[int, GrammarError] = {}
        for admitted, guide, failed in zip(constrained, masks.guides, masks.errors, strict=True):
            if failed is not None:
                errors[admitted.step.seq_id] = failed
            elif guide is not self._mirror.guide(admitted.step.seq_id):
                self._mirror.set_guide(admitted.step.seq_id, guide)
        return errors

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
        seq_ids = list(seq_ids)
        self._mirror.forget(seq_ids)
        for seq_id in seq_ids:
            self._pooled.pop(seq_id, None)

    def forget_all(self) -> None:
        """The scheduler session ended: no block table is used again."""
        self._mirror.forget_all()
        self._pooled.clear()

    def run(self, step: RunStep) -> tuple[list[SequenceOutput], StageDurations]:
        """One output per sequence of the step, in order, and the step's stage durations."""
        if self._pooling is not None:
            return self._run_pooled(step, self._pooling)
        admission = self._mirror.admit_step(step)
        outputs = dict(admission.refused)
        paged = [PagedSequence(tuple(a.step.token_ids), a.step.start_position, a.block_table,
                               needs_logits=a.step.sample, all_logits=a.step.prompt_logprobs is not None,
                               adapter=a.step.lora_adapter)
                 for a in admission.admitted]
        first_rows = _first_logit_rows(paged)
        grammar_starts = self._grammar_starts(admission.admitted)
        constrained_positions = list(grammar_starts)
        constrained = [admission.admitted[p] for p in constrained_positions]

        t_start = self.clock()
        pending_masks = self._start_masks(constrained, list(grammar_starts.values()))
        try:
            # One device-to-host copy per step (sampling runs on the host); it also waits for the GPU,
            # so compute_s covers the device work, not only its launch.
            logits = self._forward(paged).cpu() if paged else None
        finally:
            t_computed = self.clock()
            # Waited for even when the forward failed: the thread must be done with the guides.
            masks = pending_masks.result() if pending_masks is not None else None
        grammar_errors: dict[int, GrammarError] = {}
        if constrained:
            assert logits is not None  # a sampling sequence means the step ran (paged is non-empty)
            sample_rows = [first_rows[p] + _num_logit_rows(paged[p]) - 1 for p in constrained_positions]
            grammar_errors = self._take_masks(constrained, masks, logits.numpy(), sample_rows)

        for position, admitted in enumerate(admission.admitted):
            seq = admitted.step
            row = first_rows[position]
            prompt: tuple[PositionLogprobs, ...] = ()
            if seq.prompt_logprobs is not None:
                assert logits is not None  # the sequence is in the step, so the step ran
                targets = chunk_targets(seq.token_ids, seq.next_prompt_token_id)
                prompt = prompt_logprobs(logits[row:row + len(targets)], targets, seq.prompt_logprobs)
            if not seq.sample:
                self._mirror.computed(admitted)
                outputs[admitted.index] = SequenceOutput(seq.seq_id, prompt_logprobs=prompt)
                continue
            error = grammar_errors.get(seq.seq_id)
            if error is not None:
                self._mirror.forget([seq.seq_id])  # the scheduler aborts a failed sequence
                outputs[admitted.index] = SequenceOutput(seq.seq_id, error=_grammar_failure(seq.seq_id, error))
                continue
            assert logits is not None  # a sampling sequence means the step ran (paged is non-empty)
            # The sample's row: the last of the sequence's rows (already masked when constrained).
            row_logits = logits[row + _num_logit_rows(paged[position]) - 1].numpy()
            if seq.sampling.allowed_token_ids:
                # Before the bans: a ban gives way when nothing else is left, the caller's list never does.
                allowed_logits = only_allowed(row_logits, seq.sampling.allowed_token_ids)
                if allowed_logits is None:
                    self._mirror.forget([seq.seq_id])  # the scheduler aborts a failed sequence
                    outputs[admitted.index] = SequenceOutput(seq.seq_id, error=ItemError(
                        ErrorCode.INVALID_ARGUMENT, "sampling.allowed_token_ids: the grammar (structured output) "
                        f"allows none of them at output token {seq.num_generated}"))
                    continue
                row_logits = allowed_logits
            if seq.banned_token_ids:
                row_logits = without_banned(row_logits, seq.banned_token_ids)
            if seq.sampling.penalized or seq.sampling.logit_bias:
                # A masked logit stays -inf under the bias and the penalties, so masking first is the same.
                row_logits = processed_logits(row_logits, seq.sampling, admitted.token_ids, seq.num_generated)
            drawn = sample(row_logits, seq.sampling, seed=admitted.seed, index=seq.num_generated)
            self._mirror.computed(admitted, drawn.token_id)
            outputs[admitted.index] = SequenceOutput(seq.seq_id, token_id=drawn.token_id, logprob=drawn.logprob,
                                                     logprobs=drawn.logprobs, prompt_logprobs=prompt)
        t_done = self.clock()
        return [outputs[pos] for pos in range(len(step.seqs))], StageDurations(
            compute_s=t_computed - t_start, postprocess_s=t_done - t_computed
        )


    def _run_pooled(self, step: RunStep, spec: PoolingSpec) -> tuple[list[SequenceOutput], StageDurations]:
        """An embedding model's step: every sequence's chunk runs through the model to its final hidden
        states, which its pooling takes in; the chunk that ends the prompt (sample) returns the vector. The
        hidden states stay on the model's device; only the vectors come to the host."""
        for seq_id in step.finished_seq_ids:
            self._pooled.pop(seq_id, None)
        admission = self._mirror.admit_step(step)
        outputs = dict(admission.refused)
        admitted = admission.admitted
        paged = [PagedSequence(tuple(a.step.token_ids), a.step.start_position, a.block_table, needs_logits=True,
                               all_logits=True) for a in admitted]
        t_start = self.clock()
        hidden = self.generator.hidden_step(paged, self._cache) if paged else None
        t_computed = self.clock()
        row = 0
        for admitted_seq, seq in zip(admitted, paged, strict=True):
            assert hidden is not None  # the sequence is in the step, so the step ran
            seq_id, rows = admitted_seq.step.seq_id, hidden[row:row + len(seq.token_ids)]
            row += len(seq.token_ids)
            pooled = self._pooled.setdefault(seq_id, PooledSequence(spec.pooling))
            try:
                pooled.add(rows, seq.start_position)
            except ValueError as exc:  # a chunk this worker did not see the ones before
                self.forget([seq_id])  # the scheduler aborts a failed sequence
                outputs[admitted_seq.index] = SequenceOutput(seq_id, error=ItemError(
                    ErrorCode.INVALID_ARGUMENT, f"sequence {seq_id}: {exc}"))
                continue
            self._mirror.computed(admitted_seq)
            embedding = ()
            if admitted_seq.step.sample:
                embedding = tuple(pooled.vector(spec.normalize).tolist())
                del self._pooled[seq_id]
            outputs[admitted_seq.index] = SequenceOutput(seq_id, embedding=embedding)
        return [outputs[pos] for pos in range(len(step.seqs))], StageDurations(
            compute_s=t_computed - t_start, postprocess_s=self.clock() - t_computed)


def _grammar_failure(seq_id: int, error: GrammarError) -> ItemError:
    """The caller's grammar at fault reads as the scheduler's own refusal of it (`sampling.structured: `,
    which the scheduler passes on to the client as INVALID_ARGUMENT); any other failure stays the worker's."""
    if error.callers:
        return ItemError(ErrorCode.INVALID_ARGUMENT, f"sampling.structured: {error}")
    return ItemError(ErrorCode.INVALID_ARGUMENT, f"sequence {seq_id}: {error}")


def _num_logit_rows(seq: PagedSequence) -> int:
    """The rows the generator returns for the sequence: every position's, the last one's, or none."""
    if seq.all_logits:
        return len(seq.token_ids)
    return 1 if seq.needs_logits else 0


def _first_logit_rows(paged: Sequence[PagedSequence]) -> list[int]:
    """Each sequence's first row in the step's logits (the generator stacks their rows in step order)."""
    starts, row = [], 0
    for seq in paged:
        starts.append(row)
        row += _num_logit_rows(seq)
    return starts
