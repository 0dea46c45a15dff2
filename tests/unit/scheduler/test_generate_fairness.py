"""Weighted fairness of the step scheduler across admission, running slots and the token budget."""

from __future__ import annotations

import itertools
from collections import Counter

from services.common.errors import ResourceExhausted
from services.scheduler.fair_queue import Priority
from services.scheduler.kv_block_manager import KVBlockManager
from services.scheduler.sequence import SamplingParams, Sequence, SequenceStatus
from services.scheduler.step_scheduler import StepScheduler
from services.scheduler.step_scheduler_config import StepSchedulerConfig
from services.scheduler.tenant_service import TenantService

from .conftest import (
    TOKENIZER,
    FakePagedWorker,
    Transcript,
    assert_contiguous,
    fake_next_token,
    make_prompt,
    make_requests,
    make_scheduler,
    run_steps,
    tenant,
)

HEAVY, LIGHT = tenant("heavy"), tenant("light")


def expected_tokens(seq_id: int, prompt_len: int, max_tokens: int) -> list[int]:
    context = list(make_prompt(seq_id, prompt_len))
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(fake_next_token(context + out))
    return out


def step(scheduler, worker, clock, transcript: Transcript, step_s: float = 0.1):
    plan = scheduler.schedule()
    transcript.plans.append(plan)
    if plan.has_work():
        sampled = worker.run(plan)
        clock.advance(step_s)
        for delta in scheduler.update_from_output(plan, sampled):
            transcript.deltas[delta.seq_id].append(delta)
    return plan


def heavy_holds_every_slot(clock, **over):
    """Four slots, all running heavy sequences (ids 100-103, 40 tokens each), a heavy backlog
    (104-111) behind them, and one light request (id 1) arriving after three steps."""
    scheduler = make_scheduler(clock, max_num_seqs=4, **over)
    worker, transcript = FakePagedWorker(4), Transcript()
    make_requests(scheduler, 12, prompt_len=8, max_tokens=40, who=HEAVY, first_id=100)
    for _ in range(3):
        step(scheduler, worker, clock, transcript)
    make_requests(scheduler, 1, prompt_len=8, max_tokens=10, who=LIGHT, first_id=1)
    return scheduler, worker, transcript


def test_over_served_tenant_is_preempted_newest_first_when_a_same_class_tenant_waits(clock):
    scheduler, worker, transcript = heavy_holds_every_slot(clock)
    plan = step(scheduler, worker, clock, transcript)
    assert plan.preempted_seq_ids == (103,)
    assert {s.seq_id for s in plan.seqs} == {1, 100, 101, 102}
    assert scheduler.get(103).status is SequenceStatus.PREEMPTED


def test_tokens_stay_exact_after_fairness_preemption(clock):
    scheduler, worker, transcript = heavy_holds_every_slot(clock)
    run_steps(scheduler, worker, clock, transcript=transcript, step_s=0.1)
    assert sum(len(p.preempted_seq_ids) for p in transcript.plans) >= 1
    assert scheduler.get(103) is None and scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    for seq_id, max_tokens in ((1, 10), *((i, 40) for i in range(100, 112))):
        assert transcript.token_ids(seq_id) == expected_tokens(seq_id, 8, max_tokens)
        assert_contiguous(transcript, seq_id)


def test_light_tenant_is_admitted_before_the_heavy_tenants_backlog(clock):
    # Without preemption the light request waits for a slot, but takes the first one that frees.
    scheduler = make_scheduler(clock, max_num_seqs=4, enable_fairness_preemption=False)
    worker, transcript = FakePagedWorker(4), Transcript()
    for i in range(4):  # 5, 10, 15 and 20 tokens: one slot frees every five steps
        make_requests(scheduler, 1, prompt_len=8, max_tokens=5 * (i + 1), who=HEAVY, first_id=100 + i)
    make_requests(scheduler, 10, prompt_len=8, max_tokens=20, who=HEAVY, first_id=104)
    step(scheduler, worker, clock, transcript)
    make_requests(scheduler, 1, prompt_len=8, max_tokens=10, who=LIGHT, first_id=1)
    admitted = []
    while len(admitted) < 2:
        plan = step(scheduler, worker, clock, transcript)
        admitted += [s.seq_id for s in plan.seqs if s.start_position == 0]
        assert not plan.preempted_seq_ids
    assert admitted == [1, 104]


def test_no_fairness_preemption_when_no_other_tenant_waits(clock):
    scheduler = make_scheduler(clock, max_num_seqs=4, fairness_min_run_s=0.0)
    make_requests(scheduler, 12, prompt_len=8, max_tokens=20, who=HEAVY, first_id=100)
    transcript = run_steps(scheduler, FakePagedWorker(4), clock, step_s=0.1)
    assert not any(p.preempted_seq_ids for p in transcript.plans)


def test_sequences_younger_than_the_minimum_run_time_are_not_preempted_for_fairness(clock):
    scheduler, worker, transcript = heavy_holds_every_slot(clock, fairness_min_run_s=1.0)
    for _ in range(6):  # 0.3 s run so far + 0.6 s: still under a second
        plan = step(scheduler, worker, clock, transcript)
        assert not plan.preempted_seq_ids and 1 not in {s.seq_id for s in plan.seqs}
    clock.advance(0.2)
    plan = step(scheduler, worker, clock, transcript)
    assert plan.preempted_seq_ids == (103,) and 1 in {s.seq_id for s in plan.seqs}


def run_two_equal_tenants(clock, **over) -> tuple[Transcript, list[int], dict[int, float]]:
    """Heavy fills four slots, then light sends as much: both want all of them. Returns the
    transcript, the preempted ids in order, and when each sequence was last admitted."""
    scheduler = make_scheduler(clock, max_num_seqs=4, **over)
    worker, transcript = FakePagedWorker(4), Transcript()
    make_requests(scheduler, 8, prompt_len=8, max_tokens=30, who=HEAVY, first_id=100)
    started_s = clock()
    admitted_at = {s.seq_id: started_s for s in step(scheduler, worker, clock, transcript).seqs}
    make_requests(scheduler, 8, prompt_len=8, max_tokens=30, who=LIGHT, first_id=1)
    preempted = []
    while scheduler.has_work():
        now = clock()
        plan = step(scheduler, worker, clock, transcript)
        for seq_id in plan.preempted_seq_ids:
            assert now - admitted_at[seq_id] >= scheduler.config.fairness_min_run_s
            preempted.append(seq_id)
        admitted_at.update({s.seq_id: now for s in plan.seqs if s.reset_block_table})
    for seq_id in [*range(1, 9), *range(100, 108)]:
        assert transcript.token_ids(seq_id) == expected_tokens(seq_id, 8, 30)
    return transcript, preempted, admitted_at


def test_equally_served_tenants_keep_their_shares_instead_of_trading_slots(clock):
    # Light takes its 2 of 4 slots at once; after that freed slots go to whoever is below its share.
    _, preempted, _ = run_two_equal_tenants(clock, fairness_min_run_s=0.0)
    assert preempted == [103, 102]


def test_without_share_credit_slot_trading_is_bounded_by_the_minimum_run_time(clock):
    # Admission by counter alone hands a freed slot to the less-served tenant even at its share; the
    # other takes it back once the counters cross, but only from sequences that ran 0.5 s.
    _, preempted, _ = run_two_equal_tenants(clock, fairness_min_run_s=0.5, fairness_share_credit=0.0)
    assert 2 < len(preempted) <= 6


def test_priority_classes_stay_strict_over_service_counters(clock):
    scheduler = make_scheduler(clock, max_num_seqs=2, fairness_min_run_s=0.0)
    worker, transcript = FakePagedWorker(4), Transcript()
    pager, bulk = tenant("pager", Priority.CRITICAL), tenant("bulk", Priority.SHEDDABLE)
    make_requests(scheduler, 2, prompt_len=8, max_tokens=30, who=HEAVY, first_id=100)
    make_requests(scheduler, 2, prompt_len=8, max_tokens=30, who=bulk, first_id=200)
    for _ in range(3):
        step(scheduler, worker, clock, transcript)
    # The sheddable tenant has had no service at all, yet does not take a standard slot.
    assert not any(p.preempted_seq_ids for p in transcript.plans)
    assert {s.seq_id for s in transcript.plans[-1].seqs} == {100, 101}
    # A critical request takes a slot from the standard class at once, whatever the counters.
    make_requests(scheduler, 1, prompt_len=8, max_tokens=4, who=pager, first_id=1)
    plan = step(scheduler, worker, clock, transcript)
    assert plan.preempted_seq_ids == (101,) and 1 in {s.seq_id for s in plan.seqs}


def test_two_to_one_weights_give_two_to_one_tokens_under_contention(clock):
    scheduler = make_scheduler(clock, max_num_seqs=6, num_blocks=256, max_seq_len=64, fairness_min_run_s=0.0)
    worker, transcript = FakePagedWorker(4), Transcript()
    gold, basic = tenant("gold", weight=2), tenant("basic", weight=1)
    make_requests(scheduler, 40, prompt_len=8, max_tokens=24, who=gold, first_id=1000)
    make_requests(scheduler, 40, prompt_len=8, max_tokens=24, who=basic, first_id=2000)
    for _ in range(150):
        step(scheduler, worker, clock, transcript, step_s=0.01)
    tokens = Counter()
    for seq_id, deltas in transcript.deltas.items():
        tokens["gold" if seq_id < 2000 else "basic"] += sum(len(d.token_ids) for d in deltas)
    assert scheduler.num_waiting > 0  # still contended at the end
    assert 1.8 <= tokens["gold"] / tokens["basic"] <= 2.2, tokens


def test_less_served_tenants_prompt_chunk_gets_the_token_budget_first(clock):
    scheduler = make_scheduler(clock, max_num_batched_tokens=12, max_prefill_chunk_tokens=8,
                               max_long_partial_prefills=0, max_seq_len=64)
    worker, transcript = FakePagedWorker(4), Transcript()
    make_requests(scheduler, 1, prompt_len=40, max_tokens=4, who=HEAVY, first_id=100)
    clock.advance(0.001)
    make_requests(scheduler, 1, prompt_len=40, max_tokens=4, who=LIGHT, first_id=1)
    chunks = []
    for _ in range(3):
        plan = step(scheduler, worker, clock, transcript)
        chunks.append({s.seq_id: len(s.token_ids) for s in plan.seqs})
    # Heavy's older prompt goes first once; from then on each step's first chunk is the less-served tenant's.
    assert chunks == [{100: 8, 1: 4}, {1: 8, 100: 4}, {100: 8, 1: 4}]


def test_service_on_one_worker_counts_on_the_others_sharing_the_counters(clock):
    service = TenantService()
    config = StepSchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_seq_len=128, kv_watermark=0.0)
    first, second = (StepScheduler(config, KVBlockManager(64, 4), TOKENIZER, clock, service) for _ in range(2))
    make_requests(first, 2, prompt_len=8, max_tokens=20, who=HEAVY, first_id=100)
    make_requests(second, 3, prompt_len=8, max_tokens=4, who=HEAVY, first_id=200)
    clock.advance(1.0)
    make_requests(second, 1, prompt_len=8, max_tokens=4, who=LIGHT, first_id=1)
    run_steps(first, FakePagedWorker(4), clock, max_steps=5)
    # Heavy's backlog on the second worker is older, but heavy has been served on the first.
    assert [s.seq_id for s in second.schedule().seqs] == [1, 200]




def test_short_prompts_admitted_past_a_long_one_go_in_admission_order(clock):
    """When the long-prefill slot is taken, the short prompt admitted past a long one is the one
    admission itself would pick, share credit included, not another order beside it."""
    service = TenantService()
    config = StepSchedulerConfig(max_num_seqs=3, max_num_batched_tokens=32, max_seq_len=64, kv_watermark=0.0,
                                 max_prefill_chunk_tokens=8, max_long_partial_prefills=1)
    scheduler = StepScheduler(config, KVBlockManager(64, 4), TOKENIZER, clock, service)
    worker, transcript = FakePagedWorker(4), Transcript()
    long_, x, y = tenant("long"), tenant("x"), tenant("y")
    make_requests(scheduler, 1, prompt_len=40, max_tokens=4, who=long_, first_id=1)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=8, who=x, first_id=10)
    step(scheduler, worker, clock, transcript)  # 1 prefills (the long slot), 10 runs
    make_requests(scheduler, 1, prompt_len=40, max_tokens=4, who=long_, first_id=2)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=8, who=x, first_id=11)
    make_requests(scheduler, 1, prompt_len=4, max_tokens=8, who=y, first_id=20)
    # x is a little less served than y, but holds its entitled slot (one of three) while y holds none:
    # admission prefers y (share credit); "long" is the least served, but its next prompt is long.
    service.charge(x, num_decode_tokens=500)
    service.charge(y, num_decode_tokens=525)
    plan = step(scheduler, worker, clock, transcript)
    admitted = {s.seq_id for s in plan.seqs if s.start_position == 0}
    assert admitted == {20}

def flood_generate(clock, *, light_tenant: str = "light", num_steps: int = 300,
                   step_s: float = 0.01) -> tuple[StepScheduler, list[Sequence], int, int]:
    """One worker of 8 slots, 10 ms steps, sequences of an 8-token prompt and 16 output tokens (16 steps):
    capacity 50 sequences/s, 25/s each tenant's share. The light tenant sends one every 8 steps (half
    its share); the heavy tenant five every 4 steps (5x its share), so its backlog stands and fills
    the waiting queue. Deadlines of 30 s, the gateway's default. Returns the scheduler, the light
    sequences admitted, and the light and heavy requests refused."""
    scheduler = make_scheduler(clock, max_num_seqs=8, max_num_batched_tokens=64, max_num_waiting=64)
    worker = FakePagedWorker(4)
    light: list[Sequence] = []
    seq_ids = itertools.count(1)
    num_light_refused = num_heavy_refused = 0
    for step_index in range(num_steps):
        arrivals = ["heavy"] * ((step_index + 1) * 5 // 4 - step_index * 5 // 4)
        if step_index % 8 == 0:
            arrivals.insert(0, "light")
        for tag in arrivals:
            seq_id = next(seq_ids)
            who = tenant(light_tenant if tag == "light" else "heavy")
            try:
                seq = scheduler.add_request(seq_id, make_prompt(seq_id, 8), SamplingParams(max_tokens=16), who,
                                            deadline_s=clock() + 30.0)
            except ResourceExhausted:
                num_light_refused += tag == "light"
                num_heavy_refused += tag == "heavy"
            else:
                if tag == "light":
                    light.append(seq)
        plan = scheduler.schedule()
        if plan.has_work():
            sampled = worker.run(plan)
            clock.advance(step_s)
            scheduler.update_from_output(plan, sampled)
    return scheduler, light, num_light_refused, num_heavy_refused


def test_light_tenant_keeps_its_share_and_delay_bound_while_a_flood_fills_the_waiting_queue(clock):
    scheduler, light, num_light_refused, num_heavy_refused = flood_generate(clock)
    assert num_heavy_refused > 0 and scheduler.num_waiting >= 60  # the flood stands at the queue's bound (64)
    assert num_light_refused == 0  # a full queue refuses the tenant holding more than its share
    # All but the last two sent are through: it gets the half share it asks for.
    assert sum(seq.status is SequenceStatus.FINISHED for seq in light) >= len(light) - 2
    # It takes the first slot that frees: with 8 slots each freeing every 16 steps, within 4 steps.
    delays_s = [seq.first_scheduled_s - seq.arrival_s for seq in light if seq.first_scheduled_s is not None]
    assert len(delays_s) == len(light) and max(delays_s) <= 0.04 + 1e-9


def test_sharing_one_tenant_the_same_light_requests_are_refused_at_the_full_queue(clock):
    _, _, num_light_refused, _ = flood_generate(clock, light_tenant="heavy")
    assert num_light_refused > 10
