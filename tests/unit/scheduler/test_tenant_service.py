from __future__ import annotations

import pytest

from services.scheduler.fair_queue import Priority
from services.scheduler.output_stream import OutputStream
from services.scheduler.sequence import SamplingParams, Sequence, SequenceStatus
from services.scheduler.tenant_service import ServiceCost, TenantService

from .conftest import TOKENIZER, tenant


def running_seq(seq_id: int, who, *, since_s: float, arrival_s: float | None = None) -> Sequence:
    seq = Sequence(seq_id=seq_id, prompt_token_ids=(97, 98), sampling=SamplingParams(max_tokens=4), tenant=who,
                   arrival_s=since_s if arrival_s is None else arrival_s, deadline_s=None,
                   stream=OutputStream(TOKENIZER, ()))
    seq.status, seq.running_since_s = SequenceStatus.RUNNING, since_s
    return seq


def test_output_tokens_cost_twice_prompt_tokens_and_weight_divides_the_charge():
    service = TenantService()
    basic, gold = tenant("basic"), tenant("gold", weight=2)
    service.charge(basic, num_prefill_tokens=10, num_decode_tokens=5)
    service.charge(gold, num_prefill_tokens=10, num_decode_tokens=5)
    assert service.counter(basic) == 20.0
    assert service.counter(gold) == 10.0


def test_newly_active_tenant_is_lifted_to_the_least_served_active_tenant_of_its_class():
    service = TenantService()
    heavy, other, light = tenant("heavy"), tenant("other"), tenant("light")
    service.activate(heavy)
    service.activate(other)
    service.charge(heavy, num_prefill_tokens=100)
    service.charge(other, num_prefill_tokens=40)
    service.activate(light)  # was idle: no banked credit, but not below anyone active either
    assert service.counter(light) == 40.0
    service.activate(tenant("pager", Priority.CRITICAL))  # alone in its class: nothing to lift to
    assert service.counter(tenant("pager", Priority.CRITICAL)) == 0.0


def test_over_served_tenant_keeps_its_debt_across_idle_time():
    service = TenantService()
    greedy, light = tenant("greedy"), tenant("light")
    service.activate(light)
    service.activate(greedy)
    service.charge(greedy, num_prefill_tokens=500)
    service.deactivate(greedy)
    service.charge(light, num_prefill_tokens=50)
    service.activate(greedy)
    assert service.counter(greedy) == 500.0


def test_shares_follow_the_weights_of_the_active_tenants_of_one_class():
    service = TenantService()
    gold, basic, bulk = tenant("gold", weight=3), tenant("basic"), tenant("bulk", Priority.SHEDDABLE, weight=5)
    for who in (gold, basic, bulk):
        service.activate(who)
    assert (service.share(gold), service.share(basic), service.share(bulk)) == (0.75, 0.25, 1.0)
    assert service.share(tenant("newcomer")) == 0.2  # counted as if it were active
    service.deactivate(basic)
    assert service.share(gold) == 1.0
    with pytest.raises(ValueError, match="tenant 'basic' has no unfinished sequence to deactivate"):
        service.deactivate(basic)


def two_tenants_on_four_slots(clock, *, heavy_slots: int = 4) -> tuple[TenantService, list[Sequence]]:
    service = TenantService()
    heavy, light = tenant("heavy"), tenant("light")
    service.activate(heavy)
    running = []
    for i in range(heavy_slots):
        service.activate(heavy)
        running.append(running_seq(i + 1, heavy, since_s=clock()))
        clock.advance(0.1)
    service.activate(light)
    service.charge(heavy, num_decode_tokens=20)
    return service, running


def test_waiting_tenant_below_its_share_takes_the_newest_old_enough_sequence_of_the_over_served(clock):
    service, running = two_tenants_on_four_slots(clock)  # started 0.4, 0.3, 0.2 and 0.1 s ago
    victim = service.fairness_victim(tenant("light"), running, num_slots=4, now_s=clock(), min_run_s=0.15)
    assert victim is running[2]  # the newest, running[3], has run only 0.1 s


def test_no_victim_while_every_sequence_is_younger_than_the_minimum_run_time(clock):
    service, running = two_tenants_on_four_slots(clock)
    assert service.fairness_victim(tenant("light"), running, num_slots=4, now_s=clock(), min_run_s=10.0) is None
    clock.advance(10.0)
    assert service.fairness_victim(tenant("light"), running, num_slots=4, now_s=clock(), min_run_s=10.0) is running[3]


def test_no_victim_when_the_waiter_has_its_share_or_the_others_are_within_theirs(clock):
    service, running = two_tenants_on_four_slots(clock, heavy_slots=2)
    light = tenant("light")
    # Heavy holds 2 of 4 slots, its share: nothing to take even though light holds none.
    assert service.fairness_victim(light, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None
    running += [running_seq(10, light, since_s=0.0), running_seq(11, light, since_s=0.0)]
    running.append(running_seq(3, tenant("heavy"), since_s=0.0))
    # Light holds its share (2 of 4): it waits for a slot to free, it does not preempt.
    assert service.fairness_victim(light, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None


def test_swapping_one_slot_never_pays_back_at_once(clock):
    # Heavy 3 of 4 slots, light 0 and waiting: one swap, then neither may take from the other.
    service, running = two_tenants_on_four_slots(clock, heavy_slots=3)
    heavy, light = tenant("heavy"), tenant("light")
    victim = service.fairness_victim(light, running, num_slots=4, now_s=clock(), min_run_s=0.0)
    assert victim is running[2]
    running = [*running[:2], running_seq(20, light, since_s=clock())]
    clock.advance(1.0)
    service.charge(light, num_decode_tokens=1000)  # even once light is far more served
    assert service.fairness_victim(heavy, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None
    assert service.fairness_victim(light, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None


def test_no_victim_from_a_less_served_tenant_or_from_another_class(clock):
    service, running = two_tenants_on_four_slots(clock)
    light = tenant("light")
    service.charge(light, num_decode_tokens=100)  # light already got more than heavy
    assert service.fairness_victim(light, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None
    pager = tenant("pager", Priority.CRITICAL)
    service.activate(pager)
    # Other classes are not this function's business (strict classes preempt by class).
    assert service.fairness_victim(pager, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None


def test_weighted_tenant_may_hold_its_larger_share(clock):
    service = TenantService()
    gold, basic = tenant("gold", weight=3), tenant("basic")
    service.activate(gold)
    service.activate(basic)
    running = [running_seq(i, gold, since_s=0.0) for i in range(3)]
    service.charge(gold, num_decode_tokens=300)
    # Gold's share of 4 slots is 3: basic waits for the fourth, which is free.
    assert service.fairness_victim(basic, running, num_slots=4, now_s=clock(), min_run_s=0.0) is None
    running.append(running_seq(3, gold, since_s=0.0))
    assert service.fairness_victim(basic, running, num_slots=4, now_s=clock(), min_run_s=0.0) is running[3]


def test_service_cost_must_charge_output_tokens():
    with pytest.raises(ValueError, match="token costs must be prefill >= 0 and decode > 0, got 1.0 and 0.0"):
        ServiceCost(prefill_token=1.0, decode_token=0.0)


def test_a_tenants_latest_weight_sets_its_share():
    service = TenantService()
    service.activate(tenant("gold", weight=3))
    service.activate(tenant("basic"))
    service.activate(tenant("gold", weight=1))  # the gateway's configuration changed
    assert service.share(tenant("basic")) == 0.5
    service.deactivate(tenant("gold"))
    service.deactivate(tenant("gold"))
    assert service.share(tenant("basic")) == 1.0


def test_admission_prefers_a_tenant_below_its_share_unless_the_other_is_clearly_less_served(clock):
    service = TenantService()
    heavy, light = tenant("heavy"), tenant("light")
    service.activate(heavy)
    service.activate(light)
    running = [running_seq(i, light, since_s=0.0) for i in range(2)] + [running_seq(9, heavy, since_s=0.0)]
    heavy_next, light_next = running_seq(20, heavy, since_s=0.0), running_seq(21, light, since_s=0.0)
    service.charge(heavy, num_decode_tokens=60)  # heavy 120 units, light 0: within the credit
    key = service.admission_key(running, num_slots=4, share_credit=200.0)
    assert min((light_next, heavy_next), key=key) is heavy_next  # heavy holds 1 of its 2
    service.charge(heavy, num_decode_tokens=100)  # heavy 320: light is clearly less served
    key = service.admission_key(running, num_slots=4, share_credit=200.0)
    assert min((light_next, heavy_next), key=key) is light_next
