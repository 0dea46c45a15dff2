"""The step scheduler with the prefix cache: reuse, isolation, billing, exact outputs, no leaks."""

from __future__ import annotations

import random

from services.scheduler.sequence import AbortReason, SamplingParams
from services.scheduler.step_plan import SequenceStep, StepPlan
from services.scheduler.step_scheduler import StepScheduler
from tests.unit.scheduler.conftest import (
    TOKENIZER,
    FakePagedWorker,
    Transcript,
    make_scheduler,
    run_steps,
    tenant,
)

BLOCK = 4


def _add(scheduler: StepScheduler, seq_id: int, prompt: tuple[int, ...], max_tokens: int = 4, who: str = "acme"):
    return scheduler.add_request(seq_id, prompt, SamplingParams(max_tokens=max_tokens), tenant(who), deadline_s=None)


class _Run:
    """One scheduler and fake worker, stepped by hand; every delta kept."""

    def __init__(self, clock, **over) -> None:
        self.clock = clock
        self.scheduler = make_scheduler(clock, block_size=BLOCK, **over)
        self.worker = FakePagedWorker(BLOCK)
        self.transcript = Transcript()

    def add(self, seq_id: int, prompt: tuple[int, ...], max_tokens: int = 4, who: str = "acme") -> None:
        _add(self.scheduler, seq_id, prompt, max_tokens, who)

    def first_step(self, seq_id: int) -> SequenceStep:
        """Runs steps (applying their results) until `seq_id` is scheduled; its step."""
        for _ in range(100):
            plan = self.scheduler.schedule()
            steps = {s.seq_id: s for s in plan.seqs}
            if plan.has_work():
                for delta in self.scheduler.update_from_output(plan, self.worker.run(plan)):
                    self.transcript.deltas[delta.seq_id].append(delta)
            if seq_id in steps:
                return steps[seq_id]
        raise AssertionError(f"sequence {seq_id} was never scheduled")

    def finish(self) -> Transcript:
        return run_steps(self.scheduler, self.worker, self.clock, transcript=self.transcript)


PROMPT = tuple(range(97, 97 + 14))  # 14 tokens: 3 full blocks of 4, then 2 tokens


def test_a_second_sequence_with_the_same_prompt_starts_after_the_cached_blocks(clock):
    run = _Run(clock)
    scheduler = run.scheduler
    run.add(1, PROMPT)
    first = run.first_step(1)
    run.add(2, PROMPT)
    second = run.first_step(2)
    assert first.start_position == 0 and first.num_cached_tokens == 0
    assert second.reset_block_table and second.start_position == second.num_cached_tokens == 12
    assert second.token_ids == PROMPT[12:]
    assert second.new_blocks[:3] == first.new_blocks[:3] and second.new_blocks[3] != first.new_blocks[3]
    assert scheduler.cache_stats.num_hit_tokens == 12 and scheduler.cache_stats.num_hit_blocks == 3
    assert scheduler.cache_stats.num_queried_tokens == 28
    transcript = run.finish()
    assert transcript.token_ids(1) == transcript.token_ids(2) and len(transcript.token_ids(1)) == 4


def test_the_block_of_the_last_token_is_always_computed_so_the_step_can_sample(clock):
    run = _Run(clock)
    prompt = PROMPT[:8]  # exactly two full blocks
    run.add(1, prompt)
    run.first_step(1)
    run.add(2, prompt)
    second = run.first_step(2)
    assert second.num_cached_tokens == 4 and second.token_ids == prompt[4:] and second.sample


def test_another_tenant_never_reuses_a_tenants_blocks(clock):
    run = _Run(clock)
    run.add(1, PROMPT, who="acme")
    first = run.first_step(1)
    run.add(2, PROMPT, who="globex")
    second = run.first_step(2)
    assert second.start_position == 0 and second.num_cached_tokens == 0
    assert not set(second.new_blocks) & set(first.new_blocks)
    assert run.scheduler.cache_stats.num_hit_tokens == 0


def test_a_public_prefix_is_shared_across_tenants_and_what_follows_it_is_not(clock):
    system = "You are kind."  # 13 bytes: blocks 0..2 (12 tokens) lie wholly inside it
    run = _Run(clock, public_prefix_texts=(system,))
    prompt = TOKENIZER.encode(system + " Hello there, friend")  # 33 tokens
    run.add(1, prompt, who="acme")
    first = run.first_step(1)
    run.add(2, prompt, who="globex")
    second = run.first_step(2)
    assert second.num_cached_tokens == 12 and second.new_blocks[:3] == first.new_blocks[:3]
    assert second.new_blocks[3] != first.new_blocks[3]
    run.add(3, prompt, who="acme")
    third = run.first_step(3)
    assert third.num_cached_tokens == 32 and third.new_blocks[:8] == first.new_blocks[:8]  # acme's own after them
    transcript = run.finish()
    assert transcript.token_ids(1) == transcript.token_ids(2) == transcript.token_ids(3)


def test_the_tenant_is_billed_only_the_prompt_tokens_it_computes(clock):
    run = _Run(clock)
    run.add(1, PROMPT, max_tokens=1, who="acme")
    run.finish()
    service = run.scheduler._service
    after_first = service.counter(tenant("acme"))
    assert after_first == 14 * 1.0 + 1 * 2.0  # 14 prompt tokens, 1 output token
    run.add(2, PROMPT, max_tokens=1, who="acme")
    run.finish()
    assert service.counter(tenant("acme")) - after_first == 2 * 1.0 + 1 * 2.0  # 12 of 14 were cached


def test_usage_counts_the_prompt_tokens_the_cache_held(clock):
    run = _Run(clock)
    first = _add(run.scheduler, 1, PROMPT)
    run.first_step(1)
    second = _add(run.scheduler, 2, PROMPT)
    run.first_step(2)
    assert (first.num_cached_prompt_tokens, second.num_cached_prompt_tokens) == (0, 12)
    run.finish()


def test_a_long_prompt_mostly_cached_is_not_held_behind_the_long_prefill_running(clock):
    # Budget 16, chunks of 8: "long" is more than 8 tokens left to compute; one long prefill at a time.
    run = _Run(clock, max_num_batched_tokens=16, max_prefill_chunk_tokens=8, max_seq_len=64)
    long_prompt = tuple(range(97, 97 + 20))
    run.add(1, long_prompt, max_tokens=1)
    run.finish()  # its 4 full prompt blocks are cached now
    run.add(2, tuple(range(65, 65 + 20)), max_tokens=1)  # uncached: the long prefill of the next step
    run.add(3, long_prompt, max_tokens=1)  # 16 of 20 cached: 4 left to compute
    plan = run.scheduler.schedule()
    assert [(s.seq_id, s.start_position, len(s.token_ids)) for s in plan.seqs] == [(2, 0, 8), (3, 16, 4)]


def test_with_the_cache_off_every_token_is_computed(clock):
    run = _Run(clock, enable_prefix_cache=False)
    run.add(1, PROMPT)
    run.first_step(1)
    run.add(2, PROMPT)
    assert run.first_step(2).start_position == 0
    assert run.scheduler.kv.num_cached_blocks == 0 and run.scheduler.cache_stats.num_hit_tokens == 0


def test_a_preempted_sequence_resumes_from_its_own_blocks_still_cached(clock):
    scheduler = make_scheduler(clock, num_blocks=4, block_size=4, max_seq_len=16)
    worker = FakePagedWorker(4)
    _add(scheduler, 1, PROMPT[:6], max_tokens=4)
    clock.advance(1.0)
    second = _add(scheduler, 2, PROMPT[6:12], max_tokens=8)
    transcript = Transcript()
    resumed = None
    for _ in range(40):
        plan = scheduler.schedule()
        transcript.plans.append(plan)
        step = {s.seq_id: s for s in plan.seqs}.get(2)
        if step is not None and step.reset_block_table and len(transcript.plans) > 1:
            resumed = step
        if plan.has_work():
            for delta in scheduler.update_from_output(plan, worker.run(plan)):
                transcript.deltas[delta.seq_id].append(delta)
        if not scheduler.has_work():
            break
    assert any(2 in p.preempted_seq_ids for p in transcript.plans)
    assert resumed is not None and resumed.num_cached_tokens >= 4
    assert resumed.start_position == resumed.num_cached_tokens and resumed.new_blocks[0] in transcript.plans[0].seqs[1].new_blocks
    assert second.num_cached_prompt_tokens == 0, "its own blocks it computed before: not cached prompt tokens in usage"


def _shared_prefix_workload(seed: int, num_requests: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(tenant, prompt, max_tokens): a few tenants, each with a few long shared prefixes."""
    rng = random.Random(seed)
    prefixes = {who: [tuple(rng.randrange(97, 123) for _ in range(rng.randrange(4, 20))) for _ in range(3)]
                for who in ("acme", "globex", "initech")}
    requests = []
    for _ in range(num_requests):
        who = rng.choice(sorted(prefixes))
        prompt = rng.choice(prefixes[who]) + tuple(rng.randrange(97, 123) for _ in range(rng.randrange(1, 6)))
        requests.append((who, prompt, rng.randrange(1, 8)))
    return requests


def _run_interleaved(clock, requests, *, enable_prefix_cache: bool, num_blocks: int,
                     cancel_seed: int | None = None) -> tuple[StepScheduler, Transcript, set[int]]:
    """Adds the requests a few per step, interleaved with steps, cancelling some at random."""
    scheduler = make_scheduler(clock, num_blocks=num_blocks, block_size=BLOCK, max_seq_len=40, max_num_seqs=12,
                               max_num_batched_tokens=48, enable_prefix_cache=enable_prefix_cache,
                               public_prefix_texts=("dcba",))
    worker = FakePagedWorker(BLOCK)
    transcript = Transcript()
    rng = random.Random(cancel_seed)
    cancelled: set[int] = set()
    pending = list(enumerate(requests, start=1))
    while pending or scheduler.has_work():
        for _ in range(3):
            if pending and scheduler.num_waiting < 24:
                seq_id, (who, prompt, max_tokens) = pending.pop(0)
                _add(scheduler, seq_id, prompt, max_tokens, who)
        if cancel_seed is not None and rng.random() < 0.2 and scheduler.num_unfinished:
            seq_id = rng.choice(sorted(scheduler._seqs))
            scheduler.abort(seq_id, rng.choice((AbortReason.CANCELLED, AbortReason.DEADLINE_EXCEEDED)))
            cancelled.add(seq_id)
        plan: StepPlan = scheduler.schedule()
        transcript.plans.append(plan)
        if plan.has_work():
            clock.advance(0.01)
            for delta in scheduler.update_from_output(plan, worker.run(plan)):
                transcript.deltas[delta.seq_id].append(delta)
        _check_reference_counts(scheduler)
    return scheduler, transcript, cancelled


def _check_reference_counts(scheduler: StepScheduler) -> None:
    """Every block's reference count is the number of live tables holding it."""
    kv = scheduler.kv
    counts: dict[int, int] = {}
    for seq_id in scheduler._seqs:
        for block in kv.block_table(seq_id):
            counts[block] = counts.get(block, 0) + 1
    assert kv.num_used_blocks == len(counts)
    assert all(kv.ref_count(block) == n for block, n in counts.items())


def test_greedy_outputs_are_identical_with_the_cache_on_and_off_under_preemption(clock):
    requests = _shared_prefix_workload(seed=1, num_requests=300)
    on, with_cache, _ = _run_interleaved(clock, requests, enable_prefix_cache=True, num_blocks=24)
    off, without_cache, _ = _run_interleaved(clock, requests, enable_prefix_cache=False, num_blocks=24)
    for seq_id in range(1, len(requests) + 1):
        assert with_cache.token_ids(seq_id) == without_cache.token_ids(seq_id), seq_id
        assert with_cache.last(seq_id).finish_reason is not None
    assert sum(len(p.preempted_seq_ids) for p in with_cache.plans) > 10
    assert on.cache_stats.num_hit_tokens > on.cache_stats.num_queried_tokens / 4
    assert on.kv.num_evictions > 0 and on.kv.num_used_blocks == off.kv.num_used_blocks == 0


def test_no_block_reference_outlives_its_sequences_after_10000_requests(clock):
    requests = _shared_prefix_workload(seed=2, num_requests=10_000)
    scheduler, transcript, cancelled = _run_interleaved(clock, requests, enable_prefix_cache=True, num_blocks=32,
                                                        cancel_seed=3)
    kv = scheduler.kv
    assert scheduler.num_unfinished == 0
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
    assert all(kv.ref_count(block) == 0 and kv.block_table(seq_id) == ()
               for block in range(kv.num_blocks) for seq_id in (1, 5000, 10_000))
    assert len(cancelled) > 100 and kv.num_evictions > 100
    assert sum(len(p.preempted_seq_ids) for p in transcript.plans) > 100
    assert scheduler.cache_stats.num_hit_tokens > 0


def test_sequences_moved_off_a_lost_worker_free_its_blocks_and_stream_the_same_tokens(clock):
    requests = _shared_prefix_workload(seed=4, num_requests=12)
    _, reference, _ = _run_interleaved(clock, requests, enable_prefix_cache=False, num_blocks=64)
    lost = make_scheduler(clock, num_blocks=24, block_size=BLOCK, max_seq_len=40, max_num_seqs=12,
                          max_num_batched_tokens=48)
    survivor = make_scheduler(clock, num_blocks=24, block_size=BLOCK, max_seq_len=40, max_num_seqs=12,
                              max_num_batched_tokens=48)
    transcript = Transcript()
    for seq_id, (who, prompt, max_tokens) in enumerate(requests, start=1):
        _add(lost, seq_id, prompt, max_tokens, who)
    run_steps(lost, FakePagedWorker(BLOCK), clock, max_steps=3, transcript=transcript)
    assert lost.kv.num_cached_blocks > 0
    for seq in lost.evict_all():
        survivor.adopt(seq)
        assert seq.block_hashes == [], "hashes of the lost worker's block size are not kept"
    assert lost.kv.num_used_blocks == 0
    run_steps(survivor, FakePagedWorker(BLOCK), clock, transcript=transcript)
    assert survivor.kv.num_used_blocks == 0 and survivor.cache_stats.num_hit_tokens > 0
    for seq_id in range(1, len(requests) + 1):
        assert transcript.token_ids(seq_id) == reference.token_ids(seq_id), seq_id
