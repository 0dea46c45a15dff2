"""Iteration-level (continuous) batching for one generator worker.

One engine step reads: `schedule()` -> the worker runs the plan ->
`update_from_output()`. There is no prefill or decode phase, only each
sequence's `num_computed_tokens` catching up with its tokens (see sequence.py).

Each step, under `max_num_batched_tokens` and `max_num_seqs`:
1. Running sequences first, decodes before prompt chunks so decodes keep flowing
   while long prompts are split across steps (chunked prefill); prompt chunks by
   class, then least-served tenant first. A sequence that cannot get blocks preempts
   the running sequence of the lowest priority class, of its most-served tenant,
   newest first (maybe itself): its blocks are freed and it later recomputes
   prompt + generated tokens as one new prefill.
2. Then, unless step 1 preempted, preempted sequences and waiting ones are admitted
   while slots and KV blocks allow: strict priority between classes; inside a class
   the tenant with the least service so far (virtual token counters, tenant_service.py),
   its preempted sequences before its new ones. A waiting sequence that finds no room
   preempts a running one of a strictly lower class, else (fairness) one of a same-class
   tenant holding more than its weighted share of the slots (TenantService.fairness_victim).

Deadlines are checked at the start of every schedule; expired sequences are
aborted and their blocks freed in that same call, as are cancelled ones in abort().

Pipelined steps (asynchronous scheduling): with steps up to N in flight, `schedule_ahead()` plans
N+1 when N+1 needs nothing their results decide but the tokens they sample: no deadline passed, and
the blocks of every running decode's next position are free without preempting. N+1 then gives each
running sequence what schedule() would, from where the steps in flight leave it: a decode of the
token the newest step in flight holding it samples (input_from_last_sample; the worker keeps each
sequence's last sample), or of its last token when none holds it, unless max_tokens ends it in
flight; a prompt chunk from where the newest chunk in flight ends, or from its computed tokens. It
is paced as schedule() paces: the cap, and a decode may skip N+1 by the same rule, its latest token
coming when the step in flight sampling it ends (steps taking what steps take now); waiting
sequences are admitted as far as room allows without preempting. When N+1 leaves a sequence waiting
for room that schedule() would preempt for (a prompt chunk's blocks; a waiting sequence of a higher
class, or of a tenant under its share, with a victim), the step after it waits for the results and
`schedule()`; when the decodes' blocks are short or a deadline passed, N+1 itself does. Called
again, it plans N+2 from N+1, and so on: the loop decides how deep. A sequence with a bad word of
several tokens is the exception: its bans depend on its last tokens (bad_words.py), so no step
planned ahead decodes it from a sample in flight; it decodes again once that sample is back.

A sequence that the result of a step M ends (EOS, stop string, failure) or that is aborted
meanwhile is freed at once; the output for it of the steps after M already in flight is dropped.
Its blocks may be handed out again only to steps planned from then on, which the worker runs after
every step in flight; no block holding a dropped token's KV is ever registered in the prefix
cache, as registration covers only tokens whose result came back.

Prefix cache (prefix_cache.py, kv_block_manager.py): a sequence admitted (new, preempted or
adopted) starts its block table with every resident full block of its prefix, up to but not
including the block of its last token (a step must compute at least one token to sample), and
computes from there; the tenant is billed only the prompt tokens it computes. Once a step computed
a full block, the block is registered under its hash for later sequences.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import replace
from typing import Protocol

from services.common.clock import Clock
from services.common.errors import DeadlineExceeded, InvalidArgument, ResourceExhausted
from services.common.logprobs import PositionLogprobs
from services.scheduler.continuation import check_continuation
from services.scheduler.fair_queue import FairQueue, Priority, TenantContext
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.latency_predictor import (
    SHARE_ALPHA,
    LatencyPrediction,
    LatencyPredictor,
    StepTimeModel,
    slot_shares,
    steps_until_slot,
)
from services.scheduler.output_stream import OutputStream, StreamChunk
from services.scheduler.prefix_cache import (
    PrefixCacheKeys,
    PrefixCacheStats,
    cache_salt,
    extend_block_hashes,
)
from services.scheduler.sequence import (
    AbortReason,
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
    ending_token_ids,
)
from services.scheduler.step_builder import StepBuilder
from services.scheduler.step_plan import SequenceDelta, SequenceStep, StepPlan
from services.scheduler.step_scheduler_config import StepSchedulerConfig
from services.scheduler.tenant_service import TenantService
from services.scheduler.tokenizer import Tokenizer
from services.scheduler.tpot_pacing import PACE_MIN_PROMPT_TOKENS, StepPace, step_pace

# Weight of one arrival in the typical stream's smoothed prompt and max_tokens (ttft_per_queued_s).
TYPICAL_ALPHA = 0.05
# ttft_per_queued_s averages the growth over this many more sequences queued ahead: one alone reads ~0 until
# the slots are full, so a slope from one would miss a burst that fills them.
QUEUED_SLOPE_SPAN = 4


class StepSchedulerFactory(Protocol):
    """StepScheduler's constructor, or a subclass's (GeneratePool makes one per worker)."""

    def __call__(self, config: StepSchedulerConfig, kv: KVBlockManager, tokenizer: Tokenizer, clock: Clock,
                 service: TenantService | None = None) -> StepScheduler: ...


class StepScheduler:
    def __init__(self, config: StepSchedulerConfig, kv: KVBlockManager, tokenizer: Tokenizer, clock: Clock,
                 service: TenantService | None = None) -> None:
        """`service`: the tenants' service counters, shared by the schedulers of one model's workers
        so that service on one worker counts on all; None: this scheduler's own (config.service_cost)."""
        if kv.blocks_for(config.max_seq_len) > kv.num_blocks:
            # Otherwise one long sequence could preempt everyone, itself last, forever.
            raise ValueError(
                f"max_seq_len {config.max_seq_len} needs {kv.blocks_for(config.max_seq_len)} blocks, "
                f"the worker has {kv.num_blocks}"
            )
        self.config = config
        self.kv = kv
        self._tokenizer = tokenizer
        self._clock = clock
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence
        self._waiting: FairQueue[Sequence] = FairQueue(
            config.max_num_waiting, quantum=config.tenant_quantum_tokens
        )
        self._preempted: list[Sequence] = []  # sorted by preemption_key: best first
        self._running: list[Sequence] = []
        self._forget_ids: list[int] = []  # for the next plan's finished_seq_ids
        # Plans sent and not yet updated from, oldest first, with when each was planned.
        self._in_flight: deque[tuple[StepPlan, float]] = deque()
        self._last_update_s = 0.0
        # A step planned ahead left a sequence waiting for room that schedule() would make by
        # preempting: the next step is a full schedule().
        self._waits_for_room = False
        self._next_step_id = 1
        self._watermark_blocks = int(config.kv_watermark * kv.num_blocks)
        # Uncomputed tokens beyond which a sequence is a long prefill; None: none ever is (no chunking).
        chunk = config.max_prefill_chunk_tokens
        self._long_prefill_above = chunk if config.enable_chunked_prefill and chunk > 0 else None
        self.step_time_s = config.initial_step_time_s
        # Step time as a function of the batch, learned from every step (latency_predictor.py).
        self.latency = LatencyPredictor(StepTimeModel(config.initial_step_time_s), max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=config.max_num_batched_tokens)
        # Each class's share of the slots with the classes above it, running or waiting, smoothed over steps:
        # how much of the slots' turnover a lower class's queue loses to higher arrivals (predicted_latency).
        self._slot_shares = dict.fromkeys(Priority, 0.0)
        # The recent arrivals' mean prompt tokens and max_tokens (smoothed): the typical stream a gateway admits
        # between two pressure reports, for the reports' ttft_per_queued_s.
        self._typical_prompt_tokens = 1.0
        self._typical_max_tokens = 1.0
        self._service = service if service is not None else TenantService(config.service_cost)
        self.prefix_keys = PrefixCacheKeys.of(tokenizer.encode(text) for text in config.public_prefix_texts)
        self.cache_stats = PrefixCacheStats()

    # -- intake ------------------------------------------------------------

    def add_request(
        self,
        seq_id: int,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        tenant: TenantContext,
        *,
        deadline_s: float | None,
        delivered_token_ids: tuple[int, ...] = (),
        block_hashes: SequenceOf[int] = (),
        tpot_target_s: float | None = None,
    ) -> Sequence:
        """`delivered_token_ids`: a continuation, output tokens the client already received from a
        stream that broke elsewhere (see continuation.py); they are prefilled with the prompt and
        never streamed again, and sampling and chunk indexes continue after them.
        `block_hashes`: the hashes of the sequence's leading full blocks if the caller already
        computed them with this scheduler's block size and keys (cache-aware routing did), so they
        are not computed again. `tpot_target_s`: its TPOT target, which paces the steps it runs in
        (tpot_pacing.py); None: none."""
        now = self._clock()
        self._check_admissible(seq_id, prompt_token_ids, sampling, tenant, deadline_s, now)
        stream = OutputStream(self._tokenizer, sampling.stop, sampling.min_tokens, sampling.include_stop_str_in_output)
        if delivered_token_ids:
            check_continuation(delivered_token_ids, sampling, self._tokenizer)
            try:
                stream.replay(delivered_token_ids)
            except ValueError as exc:
                raise InvalidArgument(f"continuation cannot be a prefix of this stream: {exc}") from None
        seq = Sequence(
            seq_id=seq_id,
            prompt_token_ids=tuple(prompt_token_ids),
            sampling=sampling,
            tenant=tenant,
            arrival_s=now,
            deadline_s=deadline_s,
            stream=stream,
            output_token_ids=list(delivered_token_ids),
            ending_token_ids=ending_token_ids(self._tokenizer.end_token_ids, sampling.ignore_eos, sampling.stop_token_ids),
            tpot_target_s=tpot_target_s,
            output_logprobs=[None] * len(delivered_token_ids) if sampling.logprobs else [],
            prompt_logprobs=[None] * len(prompt_token_ids) if sampling.prompt_logprobs is not None else [],
            # A continuation's first chunk reached the client, and the prompt's logprobs with it.
            prompt_logprobs_sent=bool(delivered_token_ids),
        )
        if self.config.enable_prefix_cache:
            seq.cache_salt = cache_salt(tenant.tenant_id, sampling.lora_adapter)
            # Public prefixes are the base model's KV; under an adapter every block is its own.
            seq.num_public_tokens = 0 if sampling.lora_adapter else self.prefix_keys.num_public_tokens(
                seq.prompt_token_ids)
            seq.block_hashes = list(block_hashes)
        self._waiting.push_over_share(seq, tenant, cost=seq.num_tokens)
        self._seqs[seq_id] = seq
        self._typical_prompt_tokens += TYPICAL_ALPHA * (len(prompt_token_ids) - self._typical_prompt_tokens)
        self._typical_max_tokens += TYPICAL_ALPHA * (sampling.max_tokens - self._typical_max_tokens)
        self._service.activate(tenant)
        return seq

    def adopt(self, seq: Sequence, block_hashes: SequenceOf[int] = ()) -> None:
        """Takes over a sequence evicted from another worker (its generated tokens are kept).
        `block_hashes` as for add_request; the hashes it had are dropped, since they were computed
        with the other worker's block size."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled here")
        seq.block_hashes = list(block_hashes)
        if seq.status is SequenceStatus.WAITING:
            self._waiting.push_front(seq, seq.tenant, cost=seq.num_tokens)
        elif seq.status is SequenceStatus.PREEMPTED:
            self._add_preempted(seq)
        else:
            raise ValueError(f"can only adopt waiting or preempted sequences, {seq.seq_id} is {seq.status.value}")
        self._seqs[seq.seq_id] = seq
        self._service.activate(seq.tenant)

    def abort(self, seq_id: int, reason: AbortReason = AbortReason.CANCELLED) -> Sequence | None:
        """Drops the sequence and frees its blocks now; None if it is not here (already finished)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        seq.abort_reason = reason
        self._retire(seq)
        return seq

    # -- the step ----------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step, once every step in flight has been updated from (RuntimeError otherwise).

        The invariant it serves (sequence.py): there is no prefill phase and no decode phase, only
        each sequence's `num_computed_tokens` catching up with its `num_tokens`. A prompt chunk, a
        decode and a recompute after preemption are all the next tokens not yet computed; a
        sequence samples only when its step reaches its end. So one step reads: expired sequences
        aborted, the running set given its next tokens (preempting when blocks run out), then
        waiting sequences admitted, unless the running set preempted (admitting right after
        preempting would only thrash). Paced (tpot_pacing.py), the step stays within the tightest
        TPOT target running, and the decodes that may skip a step for a higher class come last.
        """
        self._check_nothing_in_flight()
        now = self._clock()
        self._waits_for_room = False
        expired = self._abort_expired(now)
        step = StepBuilder(self.config.max_num_batched_tokens, self._service)
        pace = self._pace(now)
        skipping = self._schedule_running(step, pace)
        if not step.preempted:
            self._admit(step, now, pace=pace, skipping=skipping)
        self._schedule_skipping(step, skipping, pace)
        return self._issue(step.build_steps(), now, expired=expired, preempted=step.preempted)

    def schedule_ahead(self) -> StepPlan | None:
        """The next step, planned while the steps in flight run: its decodes take their input from the
        samples of the steps in flight (or, for a sequence in none of them, its last token), paced as
        schedule() paces them, and waiting sequences that fit without preempting are admitted. None when
        a result is needed first (see the module docstring), or there is nothing to run: nothing was
        allocated, and `schedule()` follows the results."""
        if not self._in_flight:
            raise RuntimeError("schedule_ahead needs a step in flight (schedule() plans the first)")
        now = self._clock()
        step = StepBuilder(self.config.max_num_batched_tokens, self._service)
        running = self._running_ahead(step, now)
        if running is None:
            return None
        decodes, chunks = running
        if not (decodes or chunks or self._waiting or self._preempted):
            return None
        pace = self._pace(now)
        skipping = self._pick_decodes_ahead(step, decodes, pace)
        # A sequence left waiting for room where schedule() would preempt for it (a prompt chunk's
        # blocks, or a waiting sequence with a victim) makes the step after this one wait for the result;
        # waiting sequences are admitted as far as room allows without preempting.
        self._waits_for_room = (self._pick_chunks_ahead(step, chunks, skipping, pace)
                                or self._admit(step, now, may_preempt=False, pace=pace, skipping=skipping))
        self._schedule_skipping(step, skipping, pace)
        if not step.ahead and not step.picked:
            return None
        return self._issue(step.build_steps(), now)

    def _check_nothing_in_flight(self) -> None:
        if self._in_flight:
            raise RuntimeError(f"step {self._in_flight[0][0].step_id} is still running; call update_from_output "
                               f"first (or schedule_ahead)")

    def _issue(self, seqs: tuple[SequenceStep, ...], now: float, *, expired: SequenceOf[int] = (),
               preempted: SequenceOf[int] = ()) -> StepPlan:
        """The plan of a step holding `seqs`: it tells the worker which sequences to forget, and is in
        flight until update_from_output() unless it runs nothing."""
        plan = StepPlan(
            step_id=self._next_step_id,
            seqs=seqs,
            finished_seq_ids=tuple(self._forget_ids),
            expired_seq_ids=tuple(expired),
            preempted_seq_ids=tuple(preempted),
        )
        self._next_step_id += 1
        self._forget_ids.clear()
        if plan.has_work():
            self._in_flight.append((plan, now))
        return plan

    def _running_ahead(self, step: StepBuilder,
                       now: float) -> tuple[list[tuple[Sequence, float | None]], list[Sequence]] | None:
        """The running sequences a step behind those in flight holds: the decodes, each with when its
        latest token comes (None: none yet) for the skip rule, and the prompt chunks. Where a step in
        flight samples a decode's input, its position and sampling index go to `step.in_flight_samples`;
        where a prompt chunk in flight ends, to `step.in_flight_ends`. None when that step must wait for
        a result."""
        if self._waits_for_room:
            return None  # preemption for a sequence waiting for room decides the next step
        if any(seq.is_expired(now) for seq in self._seqs.values()):
            return None  # aborted by schedule(), after the result
        last, _ = self._in_flight[-1]
        in_last = {step.seq_id: step for step in last.seqs}
        older: dict[int, tuple[int, SequenceStep]] | None = None
        began_s, last_index = self._in_flight_began_s(), len(self._in_flight) - 1
        decodes: list[tuple[Sequence, float | None]] = []
        chunks: list[Sequence] = []
        num_blocks = 0
        for seq in self._running:
            sent = in_last.get(seq.seq_id)
            index = last_index
            if sent is None:  # left out of `last` (pacing, the budget): in an older step in flight, or in none
                if older is None:
                    older = self._older_in_flight_steps()
                index, sent = older.get(seq.seq_id, (-1, None))
            if sent is None:
                if seq.num_uncomputed_tokens != 1:
                    chunks.append(seq)  # from its own state, as schedule() plans it
                    continue
                start, last_token_s = seq.num_computed_tokens, seq.last_token_s
            elif not sent.sample:
                step.in_flight_ends[seq.seq_id] = sent.start_position + sent.num_new_tokens
                chunks.append(seq)
                continue
            else:
                num_generated = sent.num_generated + 1  # generated once `sent` has sampled
                if num_generated >= seq.sampling.max_tokens:
                    continue  # `sent` samples its last token
                if seq.sampling.bad_words is not None and seq.sampling.bad_words.reads_output:
                    continue  # its bans need the sample in flight: decoded once that is back
                start = sent.start_position + sent.num_new_tokens
                step.in_flight_samples[seq.seq_id] = (start, num_generated)
                last_token_s = began_s + (index + 1) * self.step_time_s
            num_blocks += self.kv.num_missing_blocks(seq.seq_id, start + 1)
            decodes.append((seq, last_token_s))
        if num_blocks > self.kv.num_free_blocks:
            return None  # preemption is decided with the result
        return decodes, chunks

    def _in_flight_began_s(self) -> float:
        """When the oldest step in flight began: sent, or when the step before it came back."""
        return max(self._in_flight[0][1], self._last_update_s)

    def _ahead_start_s(self, now: float) -> float:
        """When a step planned now starts: once the steps in flight are through, each taking what steps
        take now (the latest of the sequences' tokens in flight comes then)."""
        return max(now, self._in_flight_began_s() + len(self._in_flight) * self.step_time_s)

    def _older_in_flight_steps(self) -> dict[int, tuple[int, SequenceStep]]:
        """seq_id -> (index in flight, step) of the newest step in flight before the last that holds it."""
        newest: dict[int, tuple[int, SequenceStep]] = {}
        for index in range(len(self._in_flight) - 2, -1, -1):
            for sent in self._in_flight[index][0].seqs:
                newest.setdefault(sent.seq_id, (index, sent))
        return newest

    def _pick_decodes_ahead(self, step: StepBuilder, decodes: list[tuple[Sequence, float | None]],
                            pace: StepPace | None) -> list[Sequence]:
        """Picks the decodes of a step planned ahead as _schedule_running() picks decodes; returns those
        that may skip it (`pace`), for _schedule_skipping()."""
        if pace is None:
            for seq, _ in decodes:
                self._pick_decode(step, seq)
            return []
        start_s = self._ahead_start_s(pace.now_s)
        skipping: list[Sequence] = []
        for seq, last_token_s in sorted(decodes, key=lambda d: self._service_key(d[0])):
            if pace.may_skip_at(seq, last_token_s, start_s):
                skipping.append(seq)
                continue
            if skipping and seq.priority >= min(s.priority for s in skipping):
                self._schedule_skipping(step, skipping, pace)  # they skip only for a higher class
            self._pick_decode(step, seq)
        return skipping

    def _pick_chunks_ahead(self, step: StepBuilder, chunks: list[Sequence], skipping: list[Sequence],
                           pace: StepPace | None) -> bool:
        """Picks the prompt chunks of a step planned ahead as _schedule_running() does, but never
        preempts: True when one is left for lack of blocks (schedule() would preempt for it)."""
        for seq in sorted(chunks, key=self._service_key):
            if step.token_budget == 0:
                break
            if skipping and seq.priority >= min(s.priority for s in skipping):
                self._schedule_skipping(step, skipping, pace)  # they skip only for a higher class
                if step.token_budget == 0:
                    break
            if not self._pick_running(step, seq, pace, may_preempt=False):
                return True
        return False

    def _pick_decode(self, step: StepBuilder, seq: Sequence) -> None:
        """A running sequence's next decode in a step planned ahead (its blocks are free: _running_ahead)."""
        step.pick_decode(seq, self.kv.allocate(seq.seq_id, step.decode_end(seq)))

    @property
    def num_in_flight(self) -> int:
        """Steps planned whose result has not been applied."""
        return len(self._in_flight)

    def update_from_output(self, plan: StepPlan, sampled_token_ids: Mapping[int, int],
                           step_time_s: float | None = None,
                           logprobs: Mapping[int, PositionLogprobs] | None = None,
                           prompt_logprobs: Mapping[int, SequenceOf[PositionLogprobs]] | None = None,
                           embeddings: Mapping[int, SequenceOf[float]] | None = None,
                           ) -> list[SequenceDelta]:
        """Applies the worker's result of `plan` (the oldest step in flight): one sampled token per
        sequence whose step sampled. Sequences that ended since `plan` was made are skipped.
        `step_time_s`: what the step took, when the caller knows better than the time since the last
        result (steps whose results came back together). `logprobs`: by seq_id, what the worker
        reported for the sequences that asked; `prompt_logprobs` the same for their prompt chunks;
        `embeddings` the vectors of the embedding sequences whose prompt the step ended.

        A sampling sequence missing from `sampled_token_ids` (the worker failed it), or given
        a token outside the vocabulary, is aborted with AbortReason.FAILED and reported in its delta.
        """
        if not self._in_flight or plan is not self._in_flight[0][0]:
            raise ValueError(f"step {plan.step_id} is not the step in flight (the oldest one sent)")
        _, since_s = self._in_flight.popleft()
        now = self._clock()
        alpha = self.config.step_time_ewma_alpha
        # A pipelined step waited in the worker's queue for the one before: its time starts after that.
        began_s = max(since_s, self._last_update_s)
        self._last_update_s = now
        shared = step_time_s is not None  # its share of a command of several steps (step_pacing.py)
        if step_time_s is None:
            step_time_s = now - began_s
        # The fit clips a freeze or a starved step (latency_predictor.py); the mean learns what it learned.
        learned_s = self.latency.model.observe(len(plan.seqs), plan.num_batched_tokens, step_time_s, shared=shared)
        if learned_s is not None:
            self.step_time_s += alpha * (learned_s - self.step_time_s)
        self._learn_slot_shares()
        deltas = []
        # Looked up once per step, not once per sequence: this loop runs for every generated token.
        seqs = self._seqs
        vocab_size = self._tokenizer.vocab_size
        running = SequenceStatus.RUNNING
        block_size, cache_on = self.kv.block_size, self.config.enable_prefix_cache
        for step in plan.seqs:
            seq = seqs.get(step.seq_id)
            if seq is None or seq.status is not running:
                continue  # aborted while the step ran
            num_computed = seq.num_computed_tokens = seq.num_computed_tokens + step.num_new_tokens
            if num_computed // block_size > step.start_position // block_size and cache_on:
                self.kv.register_computed(seq.seq_id, self._block_hashes(seq, num_computed // block_size))
            if step.prompt_logprobs is not None and prompt_logprobs:
                _keep_prompt_logprobs(seq, step, prompt_logprobs.get(seq.seq_id, ()))
            if not step.sample:
                continue
            if seq.sampling.embed:
                deltas.append(self._embedded(seq, embeddings.get(seq.seq_id) if embeddings else None))
                continue
            token_id = sampled_token_ids.get(seq.seq_id)
            if token_id is None or not 0 <= token_id < vocab_size:
                self.abort(seq.seq_id, AbortReason.FAILED)
                deltas.append(self._delta(seq, StreamChunk((), "", seq.stream.num_emitted_tokens)))
                continue
            if seq.sampling.logprobs:
                seq.output_logprobs.append(logprobs.get(seq.seq_id) if logprobs else None)
            delta = self._append_token(seq, token_id, now)
            if delta is not None:
                deltas.append(delta)
        return deltas

    # -- failover ----------------------------------------------------------

    def evict_all(self) -> list[Sequence]:
        """The worker is gone: hands back every unfinished sequence, ready for another's adopt()."""
        seqs = sorted(self._seqs.values(), key=Sequence.preemption_key)
        for seq in seqs:
            self.kv.free(seq.seq_id)
            if seq.status is not SequenceStatus.WAITING:
                seq.reset_for_recompute()
        for seq in seqs:
            self._service.deactivate(seq.tenant)
        self._seqs.clear()
        self._running.clear()
        self._preempted.clear()
        self._waiting.remove_where(lambda _: True)
        self._forget_ids.clear()
        self._in_flight.clear()
        return seqs

    def evict_waiting(self) -> list[Sequence]:
        """Hands back the sequences holding no blocks (never scheduled, or preempted), ready for
        another worker's adopt(); running ones stay (a draining worker finishes them)."""
        seqs = [s for s in self._seqs.values() if s.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)]
        seqs.sort(key=Sequence.preemption_key)
        for seq in seqs:
            if seq.status is SequenceStatus.PREEMPTED:
                self._preempted.remove(seq)
            else:
                self._waiting.remove(seq)
            del self._seqs[seq.seq_id]
            self._service.deactivate(seq.tenant)
        return seqs

    # -- state -------------------------------------------------------------

    def get(self, seq_id: int) -> Sequence | None:
        return self._seqs.get(seq_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Sequences holding no blocks: never scheduled, or preempted."""
        return len(self._waiting) + len(self._preempted)

    def num_waiting_of(self, priority: Priority) -> int:
        return self._waiting.num_waiting(priority) + sum(1 for s in self._preempted if s.priority == priority)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    def has_work(self) -> bool:
        return bool(self._seqs) or bool(self._forget_ids)

    def estimated_queue_time_s(self, priority: Priority) -> float:
        """Rough wait before a new sequence of `priority` gets its first step: the prompt
        tokens queued ahead of it (classes at or above its own) at a full token budget per step."""
        tokens_ahead = sum(s.num_uncomputed_tokens for s in self._preempted if s.priority <= priority)
        tokens_ahead += sum(self._waiting.total_cost(p) for p in Priority if p <= priority)
        num_steps = -(-tokens_ahead // self.config.max_num_batched_tokens)
        return num_steps * self.step_time_s

    def ttft_per_queued_s(self, priority: Priority, base_s: float | None = None) -> float:
        """How much a new `priority` sequence's predicted TTFT grows per typical sequence (the recent arrivals'
        mean prompt and max_tokens) queued ahead of it, averaged over the next QUEUED_SLOPE_SPAN: small while
        slots are free, a slot's turnover (stretched by the higher classes' share) once they are full. A gateway
        adds it per stream it admitted since the last report (issue 36: a burst between two polls was admitted
        whole on one prediction, and its streams waited up to 3x what was predicted). `base_s`: today's
        predicted_latency(priority).ttft_s when the caller already has it."""
        if base_s is None:
            base_s = self.predicted_latency(priority).ttft_s
        ahead_s = self.predicted_latency(priority, num_queued_ahead=QUEUED_SLOPE_SPAN).ttft_s
        return max(0.0, (ahead_s - base_s) / QUEUED_SLOPE_SPAN)

    def ttft_per_prompt_token_s(self) -> float:
        """How much a new sequence's predicted TTFT grows per token of its own prompt: its prefill, chunked at the
        step's token budget beside the running decodes, averaged over one full budget of prompt tokens (the
        prediction reported per class is for a one-token prompt; a gateway tells a long prompt's own prefill from
        its wait with it)."""
        span = self.config.max_num_batched_tokens
        one_s = self.predicted_latency(Priority.CRITICAL).ttft_s
        full_s = self.predicted_latency(Priority.CRITICAL, span + 1).ttft_s
        return max(0.0, (full_s - one_s) / span)

    def predicted_latency(self, priority: Priority, num_prompt_tokens: int = 1, *,
                          num_queued_ahead: int = 0) -> LatencyPrediction:
        """TTFT and TPOT a new sequence of `priority` would see here: the prompt tokens queued at or
        above its class (the prefix cache's hits on them are known only once admitted, so counted
        whole: a pessimistic wait) and its own, next to the sequences running now, at the token budget
        the tightest TPOT running allows (tpot_pacing.py), behind the steps in flight; and, with the
        slots full, the steps until one is free for it. Running sequences of a lower class do not count (it
        would preempt them), nor do the waiting ones of a lower class (admitted after it). Its wait
        stretches with the share of the slots higher classes hold or wait for (their arrivals go first).
        `num_queued_ahead`: as if that many more typical sequences waited ahead of it (ttft_per_queued_s)."""
        pace = self._pace(self._clock())
        extra_tokens = round(num_queued_ahead * self._typical_prompt_tokens)
        return self.latency.predict(num_tokens_ahead=self._tokens_ahead(priority) + extra_tokens,
                                    num_prompt_tokens=num_prompt_tokens,
                                    num_running=len(self._running),
                                    num_steps_to_slot=self._steps_until_slot(priority, num_queued_ahead),
                                    token_budget=None if pace is None else pace.token_budget(len(self._running)),
                                    num_steps_in_flight=len(self._in_flight),
                                    higher_share=self._higher_share(priority))

    def _higher_share(self, priority: Priority) -> float:
        """The smoothed share of the slots that classes strictly above `priority` hold or wait for."""
        return 0.0 if priority == min(Priority) else self._slot_shares[Priority(priority - 1)]

    def _learn_slot_shares(self) -> None:
        """One step's look at who holds or waits for the slots, into the smoothed shares."""
        num_by_class = dict.fromkeys(Priority, 0)
        for seq in self._running:
            num_by_class[seq.priority] += 1
        for priority in Priority:
            num_by_class[priority] += self.num_waiting_of(priority)
        for priority, share in slot_shares(self.config.max_num_seqs, num_by_class).items():
            self._slot_shares[priority] += SHARE_ALPHA * (share - self._slot_shares[priority])

    def _steps_until_slot(self, priority: Priority, num_queued_ahead: int = 0) -> int:
        """Steps before a slot is free for a new sequence of `priority` (latency_predictor.steps_until_slot):
        each sequence holds its slot for the tokens it has left to max_tokens (an upper bound: EOS and
        stop strings end some sooner); `num_queued_ahead` typical sequences more wait ahead of it."""
        holding = [s.sampling.max_tokens - s.num_generated for s in self._running if s.priority <= priority]
        if len(holding) + self.num_waiting + num_queued_ahead < self.config.max_num_seqs:
            return 0  # a slot is free for it however the queue ahead is admitted
        ahead = [s.sampling.max_tokens - s.num_generated for s in (*self._preempted, *self._waiting)
                 if s.priority <= priority]
        ahead += [round(self._typical_max_tokens)] * num_queued_ahead
        return steps_until_slot(self.config.max_num_seqs, holding, ahead)

    def _tokens_ahead(self, priority: Priority) -> int:
        tokens_ahead = sum(s.num_uncomputed_tokens for s in self._preempted if s.priority <= priority)
        return tokens_ahead + sum(self._waiting.total_cost(p) for p in Priority if p <= priority)

    # -- internals ---------------------------------------------------------

    def _check_admissible(self, seq_id, prompt_token_ids, sampling, tenant, deadline_s, now) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if not prompt_token_ids:
            raise InvalidArgument("prompt must be non-empty")
        total = len(prompt_token_ids) + sampling.num_output_positions
        if total > self.config.max_seq_len:
            raise InvalidArgument(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds the model's max_seq_len {self.config.max_seq_len}"
            )
        if not self.config.enable_chunked_prefill and len(prompt_token_ids) > self.config.max_num_batched_tokens:
            raise InvalidArgument(
                f"prompt ({len(prompt_token_ids)} tokens) exceeds max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens} and chunked prefill is off"
            )
        if deadline_s is not None and deadline_s <= now:
            raise DeadlineExceeded("deadline passed before the sequence was queued")
        if not self._waiting.has_room_for(tenant):  # full, and no other tenant holds more than its share
            raise ResourceExhausted(
                f"generate queue full: {len(self._waiting)} sequences waiting",
                retry_after_s=max(self.step_time_s, self.estimated_queue_time_s(tenant.priority)),
            )

    def _abort_expired(self, now: float) -> list[int]:
        expired = [seq.seq_id for seq in self._seqs.values() if seq.is_expired(now)]
        for seq_id in expired:
            self.abort(seq_id, AbortReason.DEADLINE_EXCEEDED)
        return expired

    def _schedule_running(self, step: StepBuilder, pace: StepPace | None = None) -> list[Sequence]:
        """Picks the running sequences; returns the decodes that may skip this step (`pace`), for
        _schedule_skipping() once the rest of the step is planned."""
        # Decodes (one token) first, then prompt chunks; each by class, then least-served tenant, then age.
        order = sorted(self._running, key=lambda s: (s.num_uncomputed_tokens > 1, self._service_key(s)))
        skipping = []
        for seq in order:
            if step.token_budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if pace is not None and pace.may_skip(seq):
                skipping.append(seq)
                continue
            if skipping and seq.priority >= min(s.priority for s in skipping):
                self._schedule_skipping(step, skipping, pace)  # they skip only for a higher class
                if step.token_budget == 0:
                    break
            self._pick_running(step, seq, pace)
        return skipping

    def _pick_running(self, step: StepBuilder, seq: Sequence, pace: StepPace | None, *,
                      may_preempt: bool = True) -> bool:
        """Picks a running sequence's next tokens (a decode, or a prompt chunk cut to the budget and the
        pace's cap), preempting when blocks run out; False when it could not get its blocks without
        preempting (`may_preempt` False: a step planned ahead)."""
        start = step.start_of(seq)
        long = self._is_long_prefill(seq, start)
        if long and self._long_prefills_full(step):
            return True  # it keeps its blocks and resumes when an earlier long prompt is through
        num_new = self._num_tokens_to_compute(seq, step.token_budget, start)
        if num_new > 1 and pace is not None:  # a prompt chunk is cut to the cap; a decode cannot be
            num_new = min(num_new, self._tokens_allowed(step, pace))
            if num_new == 0:
                return True
        num_tokens = start + num_new
        if not may_preempt and not self.kv.can_allocate(seq.seq_id, num_tokens):
            return False
        if self._make_room(seq, num_tokens, step):
            step.pick(seq, num_new, self.kv.allocate(seq.seq_id, num_tokens))
            step.num_long_prefills += long
        return True

    def _schedule_skipping(self, step: StepBuilder, skipping: list[Sequence], pace: StepPace | None) -> None:
        """The decodes that could skip this step, by class then longest since their last token (so they
        take turns), while the cap, the token budget and the free blocks allow (one left out is picked
        next step: it never preempts to run now). Empties `skipping`."""
        skipping.sort(key=lambda s: (int(s.priority), s.last_token_s or 0.0, s.seq_id))
        candidates = skipping[:]
        skipping.clear()
        for seq in candidates:
            if step.token_budget == 0:
                return
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted for a sequence picked or admitted before it
            num_tokens = step.decode_end(seq)
            if pace is not None and self._tokens_allowed(step, pace, prompt=False) < 1:
                continue
            if self.kv.can_allocate(seq.seq_id, num_tokens):
                step.pick_decode(seq, self.kv.allocate(seq.seq_id, num_tokens))

    def _pace(self, now: float) -> StepPace | None:
        waiting_top = min((p for p in Priority if self.num_waiting_of(p)), default=None)
        return step_pace(self.latency.model.cost, self._running, waiting_top, step_s=self.step_time_s, now_s=now)

    def _tokens_allowed(self, step: StepBuilder, pace: StepPace, *, prompt: bool = True) -> int:
        """Tokens one more sequence may compute in `step` within the pace's cap; for a prompt chunk, at
        least what is left of the floor of prompt tokens a step may always compute
        (tpot_pacing.PACE_MIN_PROMPT_TOKENS)."""
        num_tokens = self.config.max_num_batched_tokens - step.token_budget
        allowed = pace.tokens_allowed(len(step.picked) + len(step.ahead), num_tokens)
        if not prompt:
            return allowed
        num_prompt_tokens = sum(num_new for _, num_new, _ in step.picked.values() if num_new > 1)
        return max(allowed, PACE_MIN_PROMPT_TOKENS - num_prompt_tokens)

    def _make_room(self, seq: Sequence, num_tokens: int, step: StepBuilder) -> bool:
        """Preempts running sequences (lowest class, most-served tenant, newest first) until `seq` fits;
        False when `seq` itself was the one to go."""
        while not self.kv.can_allocate(seq.seq_id, num_tokens):
            victim = max(self._running, key=self._service_key)
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _admit(self, step: StepBuilder, now: float, *, may_preempt: bool = True, pace: StepPace | None = None,
               skipping: list[Sequence] | None = None) -> bool:
        """Admits waiting sequences while the budget (and the pace's cap) allows; True when one was left
        for lack of room (slots or blocks) that preempting a victim would make (`may_preempt` False: a
        step planned ahead); one with no victim (_victim_for) ends admission there, as schedule() does.
        `skipping`: decodes that may skip this step, but only for a higher class: they are picked before
        a sequence of their class or below is admitted."""
        while step.token_budget > 0:
            seq = self._next_to_admit()
            if seq is not None and self._long_prefills_full(step) and self._is_long_admission(seq):
                seq = self._short_waiting(seq.priority)
            if seq is None or seq.seq_id in step.preempted:
                return False
            if skipping and seq.priority >= min(s.priority for s in skipping):
                self._schedule_skipping(step, skipping, pace)
                continue  # the budget changed
            prefix = self._cached_prefix(seq)
            num_cached = len(prefix) * self.kv.block_size
            num_new = self._num_tokens_to_compute(seq, step.token_budget, start=num_cached)
            if pace is not None:
                num_new = min(num_new, self._tokens_allowed(step, pace))
                if num_new == 0:
                    return False  # the step is as long as the tightest TPOT running allows
            if not self._fits_unchunked(seq, num_new, start=num_cached):
                return False
            num_tokens = num_cached + num_new
            if not self._has_room(prefix, num_tokens):
                victim = self._victim_for(seq, now)
                if victim is None:
                    return False  # schedule() would not make room either
                if not may_preempt:
                    return True
                self._preempt(victim, step)
                continue
            self._start_running(seq, now)
            table = self.kv.allocate_prefixed(seq.seq_id, prefix, num_tokens)
            self._reuse_cached(seq, num_cached)
            step.pick(seq, num_new, table)
            step.num_long_prefills += self._is_long_prefill(seq)
        return False

    def _has_room(self, prefix: list[int], num_tokens: int) -> bool:
        """Whether a sequence starting with the cached blocks `prefix` may be admitted to cover `num_tokens`."""
        if len(self._running) >= self.config.max_num_seqs:
            return False
        # The watermark only protects running sequences; with none, everything is free to use.
        reserve = self._watermark_blocks if self._running else 0
        return self.kv.can_allocate_prefixed(prefix, num_tokens, reserve_blocks=reserve)

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The hashes of the resident full blocks `seq` (holding no blocks) may start with: never the
        block of its last token, which a step must compute to sample."""
        max_blocks = (seq.num_tokens - 1) // self.kv.block_size
        # Prompt logprobs come from every prompt position's forward, so they read no cached block
        # (vLLM's rule; their blocks are still registered for others); nor does an embedding, whose
        # pooling (mean, CLS) may read every position's hidden state, which the worker keeps for none.
        if (not self.config.enable_prefix_cache or max_blocks == 0 or seq.needs_prompt_logprobs
                or seq.sampling.embed):
            return []
        hashes = self._block_hashes(seq, max_blocks)
        return hashes[:self.kv.num_cached_prefix_blocks(hashes[:max_blocks])]

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The sequence's block hashes, extended to at least its first `num_blocks` full blocks."""
        hashes = seq.block_hashes
        if len(hashes) < num_blocks:
            block_size = self.kv.block_size
            extend_block_hashes(hashes, seq.token_ids(len(hashes) * block_size, num_blocks * block_size),
                                block_size, seq.cache_salt, num_public_tokens=seq.num_public_tokens)
        return hashes

    def _reuse_cached(self, seq: Sequence, num_cached: int) -> None:
        """`seq` starts with `num_cached` tokens' KV from the cache: it computes from there, and the
        prompt tokens among them are not billed to its tenant."""
        seq.num_computed_tokens = seq.num_cached_tokens = num_cached
        num_cached_prompt = min(num_cached, seq.num_prompt_tokens)
        seq.num_cached_prompt_tokens += max(0, num_cached_prompt - seq.num_billed_prompt_tokens)
        seq.num_billed_prompt_tokens = max(seq.num_billed_prompt_tokens, num_cached_prompt)
        stats = self.cache_stats
        stats.num_queried_blocks += (seq.num_tokens - 1) // self.kv.block_size
        stats.num_queried_tokens += seq.num_tokens
        stats.num_hit_blocks += num_cached // self.kv.block_size
        stats.num_hit_tokens += num_cached

    def _start_running(self, seq: Sequence, now: float) -> None:
        self._take_for_admission(seq)
        seq.status = SequenceStatus.RUNNING
        seq.running_since_s = now
        if seq.first_scheduled_s is None:
            seq.first_scheduled_s = now
        self._running.append(seq)

    def _next_to_admit(self) -> Sequence | None:
        """Classes are strict; inside one, the least-served tenant (ties: oldest first), its preempted
        sequences before its new ones."""
        heads = self._tenant_heads()
        if not heads:  # most steps at full load: no tenant counting over the running set for nobody
            return None
        return min(heads, key=self._admission_key())

    def _admission_key(self) -> Callable[[Sequence], tuple[int, float, float, int]]:
        """The one order in which waiting tenants are admitted (TenantService.admission_key)."""
        return self._service.admission_key(self._running, self.config.max_num_seqs, self.config.fairness_share_credit)

    def _tenant_heads(self) -> list[Sequence]:
        """Each waiting tenant's next sequence: its best preempted one, else its oldest new one."""
        heads: dict[tuple[Priority, str], Sequence] = {}
        for seq in (*self._preempted, *self._waiting.heads()):
            heads.setdefault((seq.priority, seq.tenant.tenant_id), seq)
        return list(heads.values())

    def _service_key(self, seq: Sequence) -> tuple[int, float, float, int]:
        """Smaller is served first (and preempted last): higher class, less-served tenant, older."""
        return (int(seq.priority), self._service.counter(seq.tenant), seq.arrival_s, seq.seq_id)

    def _is_long_prefill(self, seq: Sequence, start: int | None = None) -> bool:
        """Whether `seq` has more than a chunk left to compute from `start` (default: its computed tokens)."""
        above = self._long_prefill_above
        if above is None:
            return False
        return seq.num_tokens - (seq.num_computed_tokens if start is None else start) > above

    def _is_long_admission(self, seq: Sequence) -> bool:
        """Whether a waiting or preempted `seq` would be a long prefill once admitted: what its cached
        prefix leaves to compute (a mostly cached long prompt is not one)."""
        if not self._is_long_prefill(seq):
            return False
        above = self._long_prefill_above
        assert above is not None  # _is_long_prefill said so
        return seq.num_tokens - len(self._cached_prefix(seq)) * self.kv.block_size > above

    def _long_prefills_full(self, step: StepBuilder) -> bool:
        cap = self.config.max_long_partial_prefills
        return cap > 0 and step.num_long_prefills >= cap

    def _short_waiting(self, priority: Priority) -> Sequence | None:
        """The waiting sequence of `priority` that is not a long prefill, of the tenant admission
        would pick among those that have one (then oldest), to admit past long prompts that must
        wait for the one prefilling."""
        firsts: dict[str, Sequence] = {}  # each tenant's oldest short one
        for seq in self._waiting:
            if seq.priority == priority and seq.tenant.tenant_id not in firsts and not self._is_long_admission(seq):
                firsts[seq.tenant.tenant_id] = seq
        if not firsts:
            return None
        return min(firsts.values(), key=self._admission_key())

    def _take_for_admission(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.PREEMPTED:
            self._preempted.remove(seq)
        else:
            self._waiting.take(seq)

    def _num_tokens_to_compute(self, seq: Sequence, token_budget: int, start: int | None = None) -> int:
        """Tokens `seq` computes this step, from `start` (default: its computed tokens) on."""
        num_left = seq.num_tokens - (seq.num_computed_tokens if start is None else start)
        cap = self.config.max_prefill_chunk_tokens or token_budget
        return min(num_left, token_budget, cap)

    def _fits_unchunked(self, seq: Sequence, num_new: int, start: int) -> bool:
        num_left = seq.num_tokens - start
        if self.config.enable_chunked_prefill or num_new == num_left:
            return True
        # A recompute longer than a whole step can only ever go in chunks.
        return num_left > self.config.max_num_batched_tokens

    def _victim_for(self, seq: Sequence, now: float) -> Sequence | None:
        """The running sequence to preempt to make room for waiting `seq`: one of a strictly lower class,
        else one of a same-class tenant above its weighted share; None when neither exists."""
        lower = [s for s in self._running if s.priority > seq.priority]
        if lower:
            return max(lower, key=self._service_key)
        if self.config.enable_fairness_preemption:
            return self._service.fairness_victim(seq.tenant, self._running, self.config.max_num_seqs, now,
                                                 self.config.fairness_min_run_s)
        return None

    def _preempt(self, seq: Sequence, step: StepBuilder) -> None:
        step.unpick(seq)
        step.preempted.append(seq.seq_id)
        self._running.remove(seq)
        self.kv.free(seq.seq_id)
        self._forget_ids.append(seq.seq_id)
        seq.reset_for_recompute()
        seq.num_preemptions += 1
        self._add_preempted(seq)

    def _add_preempted(self, seq: Sequence) -> None:
        keys = [s.preemption_key() for s in self._preempted]
        self._preempted.insert(bisect.bisect(keys, seq.preemption_key()), seq)

    def _append_token(self, seq: Sequence, token_id: int, now: float) -> SequenceDelta | None:
        seq.output_token_ids.append(token_id)
        if seq.first_token_s is None:
            seq.first_token_s = now
            seq.first_token_index = seq.num_generated
        seq.last_token_s = now
        end_token_id = None
        if token_id in seq.ending_token_ids:
            reason = FinishReason.EOS  # an end-of-sequence token is counted, never streamed...
            end_token_id = token_id
            if seq.sampling.include_stop_str_in_output and token_id in seq.sampling.stop_token_ids:
                seq.stream.append(token_id)  # ...but a request's stop token's text when asked
        elif seq.stream.append(token_id):
            reason = FinishReason.STOP
        elif seq.num_generated >= seq.sampling.max_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
        if reason is not None:
            seq.finish_reason = reason
            self._retire(seq)
        chunk = seq.stream.take(final=reason is not None)
        if not chunk and reason is None:
            return None
        return self._delta(seq, chunk, end_token_id)

    def _embedded(self, seq: Sequence, embedding: SequenceOf[float] | None) -> SequenceDelta:
        """An embedding sequence whose prompt the worker finished: it ends with its vector, or fails
        without one (a worker that sent none)."""
        if not embedding:
            self.abort(seq.seq_id, AbortReason.FAILED)
        else:
            seq.embedding = tuple(embedding)
            seq.finish_reason = FinishReason.STOP
            self._retire(seq)
        return replace(self._delta(seq, StreamChunk((), "", 0)), embedding=seq.embedding)

    def _delta(self, seq: Sequence, chunk: StreamChunk, end_token_id: int | None = None) -> SequenceDelta:
        sampling = seq.sampling
        delta = SequenceDelta(
            end_token_id=end_token_id,
            seq_id=seq.seq_id,
            token_ids=chunk.token_ids,
            text=chunk.text,
            index=chunk.index,
            finish_reason=seq.finish_reason,
            abort_reason=seq.abort_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_generated=len(seq.output_token_ids),
            logprobs=(tuple(seq.output_logprobs[chunk.index : chunk.index + len(chunk.token_ids)])
                      if sampling.logprobs else ()),
        )
        if sampling.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            # The prompt's logprobs go on the stream's first chunk only.
            seq.prompt_logprobs_sent = True
            delta.prompt_token_ids = seq.prompt_token_ids
            delta.prompt_logprobs = tuple(seq.prompt_logprobs)
        return delta

    def _retire(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence from every list and frees its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SequenceStatus.PREEMPTED:
            self._preempted.remove(seq)
        else:
            self._waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        del self._seqs[seq.seq_id]
        self._service.deactivate(seq.tenant)

    def _release(self, seq: Sequence) -> None:
        if self.kv.free(seq.seq_id) or seq.first_scheduled_s is not None:
            self._forget_ids.append(seq.seq_id)


def _keep_prompt_logprobs(seq: Sequence, step: SequenceStep, reported: SequenceOf[PositionLogprobs]) -> None:
    """Files a prompt chunk's reported logprobs under the prompt positions they are for (start + 1 on);
    a recomputed chunk's overwrite the same positions."""
    slots = seq.prompt_logprobs
    for offset, position in enumerate(reported[: len(slots) - step.start_position - 1]):
        slots[step.start_position + 1 + offset] = position

