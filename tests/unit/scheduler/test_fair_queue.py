from __future__ import annotations

from collections import Counter

import pytest

from services.common.errors import ResourceExhausted
from services.scheduler.fair_queue import FairQueue, Priority

from .conftest import tenant


def drain(queue: FairQueue) -> list:
    return [queue.pop() for _ in range(len(queue))]


def test_serves_higher_priority_class_first_regardless_of_arrival():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("shed", tenant("a", Priority.SHEDDABLE))
    queue.push("std", tenant("b", Priority.STANDARD))
    queue.push("crit", tenant("c", Priority.CRITICAL))
    assert drain(queue) == ["crit", "std", "shed"]


def test_alternates_between_equal_weight_tenants_and_keeps_each_tenants_order():
    queue: FairQueue[str] = FairQueue(10)
    for i in range(3):
        queue.push(f"a{i}", tenant("a"))
    for i in range(3):
        queue.push(f"b{i}", tenant("b"))
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_weighted_tenant_gets_service_in_proportion_to_weight():
    queue: FairQueue[str] = FairQueue(100)
    for i in range(30):
        queue.push(f"heavy{i}", tenant("heavy", weight=3))
        queue.push(f"light{i}", tenant("light", weight=1))
    first_twenty = [queue.pop() for _ in range(20)]
    counts = Counter(item.rstrip("0123456789") for item in first_twenty)
    assert counts == {"heavy": 15, "light": 5}


def test_light_tenant_is_served_promptly_behind_a_heavy_backlog():
    queue: FairQueue[str] = FairQueue(1000)
    for i in range(500):
        queue.push(f"heavy{i}", tenant("heavy"))
    queue.push("light", tenant("light"))
    order = drain(queue)
    assert order.index("light") <= 2


def test_cost_makes_fairness_count_tokens_not_entries():
    queue: FairQueue[str] = FairQueue(100, quantum=100)
    for i in range(10):
        queue.push(f"long{i}", tenant("long"), cost=400)
        queue.push(f"short{i}", tenant("short"), cost=100)
    first = [queue.pop() for _ in range(10)]
    counts = Counter(item.rstrip("0123456789") for item in first)
    # Four short entries per long one: both tenants got 800 tokens of service.
    assert counts == {"short": 8, "long": 2}


def test_emptied_tenant_forfeits_credit_so_idling_banks_nothing():
    queue: FairQueue[str] = FairQueue(100, quantum=1)
    queue.push("idle0", tenant("idle", weight=5))
    assert queue.pop() == "idle0"
    for i in range(4):
        queue.push(f"busy{i}", tenant("busy"))
    for i in range(4):
        queue.push(f"idle{i + 1}", tenant("idle", weight=5))
    # Only the weight shapes the share, not earlier unused credit.
    assert drain(queue)[:2] == ["busy0", "idle1"]


def test_push_on_full_raises_resource_exhausted_with_retry_hint():
    queue: FairQueue[int] = FairQueue(2, retry_after_s=0.25)
    queue.push(1, tenant())
    queue.push(2, tenant("other"))
    with pytest.raises(ResourceExhausted, match="queue full: 2 requests waiting") as info:
        queue.push(3, tenant())
    assert info.value.retry_after_s == 0.25
    assert len(queue) == 2


def test_push_front_ignores_the_bound_and_goes_first_for_its_tenant():
    queue: FairQueue[str] = FairQueue(1)
    queue.push("new", tenant("a"))
    queue.push_front("requeued", tenant("a"))
    assert len(queue) == 2
    assert drain(queue) == ["requeued", "new"]


def test_remove_where_drops_matching_entries_and_keeps_service_order():
    queue: FairQueue[int] = FairQueue(20)
    for i in range(6):
        queue.push(i, tenant("a" if i % 2 else "b"))
    assert sorted(queue.remove_where(lambda i: i in (1, 2, 5))) == [1, 2, 5]
    assert 2 not in queue
    assert drain(queue) == [0, 3, 4]


def test_removing_the_visited_tenants_last_entry_hands_the_turn_on():
    queue: FairQueue[str] = FairQueue(10)
    queue.push("a0", tenant("a"))
    queue.push("b0", tenant("b"))
    assert queue.peek() == "a0"
    assert queue.remove("a0")
    assert not queue.remove("a0")
    assert queue.pop() == "b0"
    assert not queue


def test_peek_returns_what_pop_returns():
    queue: FairQueue[str] = FairQueue(10, quantum=1)
    for i in range(3):
        queue.push(f"a{i}", tenant("a", weight=2))
        queue.push(f"b{i}", tenant("b"))
    while queue:
        expected = queue.peek()
        assert queue.pop() == expected


def test_cost_ahead_counts_higher_classes_and_a_fair_share_of_the_own_class():
    queue: FairQueue[str] = FairQueue(100)
    for i in range(5):
        queue.push(f"crit{i}", tenant("c", Priority.CRITICAL))
    for i in range(50):
        queue.push(f"heavy{i}", tenant("heavy"))
    # A new light-tenant entry waits behind all critical work and one heavy entry per round.
    assert queue.cost_ahead(tenant("light")) == 5 + 1
    # The heavy tenant's next entry waits behind its own backlog.
    assert queue.cost_ahead(tenant("heavy")) == 5 + 50
    assert queue.cost_ahead(tenant("c", Priority.CRITICAL)) == 5


def test_pop_from_empty_queue_raises_and_peek_returns_none():
    queue: FairQueue[int] = FairQueue(1)
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_rejects_bad_construction_and_duplicate_items():
    with pytest.raises(ValueError, match="max_size must be >= 1"):
        FairQueue(0)
    with pytest.raises(ValueError, match="quantum must be >= 1"):
        FairQueue(1, quantum=0)
    queue: FairQueue[object] = FairQueue(5)
    item = object()
    queue.push(item, tenant())
    with pytest.raises(ValueError, match="already queued"):
        queue.push(item, tenant())
    with pytest.raises(ValueError, match="cost must be >= 1"):
        queue.push(object(), tenant(), cost=0)


def test_a_full_queue_displaces_the_newest_entry_of_the_longest_tenant():
    queue: FairQueue[str] = FairQueue(4)
    for i in range(3):
        queue.push(f"heavy{i}", tenant("heavy"))
    queue.push("light0", tenant("light"))
    assert queue.can_displace_for(tenant("light"))
    assert queue.push_displacing("light1", tenant("light")) == "heavy2"
    assert sorted(drain(queue)) == ["heavy0", "heavy1", "light0", "light1"]


def test_displacement_never_takes_from_a_higher_class_or_a_shorter_queue():
    queue: FairQueue[str] = FairQueue(4)
    for i in range(2):
        queue.push(f"crit{i}", tenant("pager", Priority.CRITICAL))
        queue.push(f"std{i}", tenant("app"))
    with pytest.raises(ResourceExhausted, match=r"queue full: 4 requests waiting \(max 4\)"):
        queue.push_displacing("shed", tenant("batch", Priority.SHEDDABLE))
    # app holds two, a newcomer of its class would hold one: app's newest goes.
    assert queue.push_displacing("std-new", tenant("other")) == "std1"
    # Now app and other hold one and one: nothing longer than the newcomer's own would be.
    assert not queue.can_displace_for(tenant("other"))


def test_displacement_weighs_queue_lengths_by_tenant_weight():
    queue: FairQueue[str] = FairQueue(4)
    for i in range(3):
        queue.push(f"big{i}", tenant("big", weight=3))
    queue.push("small0", tenant("small"))
    # big may hold three times what small holds: 3 entries vs small's 2 after the push is within share.
    assert not queue.can_displace_for(tenant("small"))


def test_an_entry_taken_out_of_turn_is_charged_to_its_tenant():
    queue: FairQueue[str] = FairQueue(10)
    entries = {}
    for i in range(3):
        for who in "ab":
            entries[f"{who}{i}"] = f"{who}{i}"
            queue.push(entries[f"{who}{i}"], tenant(who))
    queue.take(entries["b1"])  # served past a0 and b0: b owes a turn (entries are matched by identity)
    assert entries["b1"] not in queue and len(queue) == 5
    assert drain(queue) == ["a0", "a1", "b0", "a2", "b2"]


def test_newest_first_and_head_first_choose_within_the_tenant_drr_picked():
    queue: FairQueue[str] = FairQueue(10, quantum=1)
    for name in ("old-a0", "a1", "a2"):
        queue.push(name, tenant("a", weight=2))
    for name in ("old-b0", "b1"):
        queue.push(name, tenant("b"))
    aged = {"old-a0", "old-b0"}
    served = [queue.pop(newest=True, head_first=aged.__contains__) for _ in range(5)]
    # Weights 2:1 still decide the tenants; each tenant's aged head goes first, then its newest.
    assert served == ["old-a0", "a2", "old-b0", "a1", "b1"]


def test_a_full_queue_refuses_the_longest_tenant_and_admits_the_others_over_the_bound():
    queue: FairQueue[str] = FairQueue(4)
    for i in range(4):
        queue.push_over_share(f"heavy{i}", tenant("heavy"))
    with pytest.raises(ResourceExhausted, match=r"queue full: 4 requests waiting \(max 4\)"):
        queue.push_over_share("heavy4", tenant("heavy"))
    assert queue.has_room_for(tenant("light"))
    for i in range(3):  # nothing accepted is dropped for them
        queue.push_over_share(f"light{i}", tenant("light"))
    assert len(queue) == 7
    # A fourth would give light as many as heavy: no longer under the longest's share, refused.
    assert not queue.has_room_for(tenant("light"))
    assert queue.has_room_for(tenant("pager", Priority.CRITICAL))
    assert not queue.has_room_for(tenant("batch", Priority.SHEDDABLE))  # nobody below it to refuse instead


def test_an_entry_put_back_returns_to_its_end_of_its_tenants_queue_with_its_credit():
    queue: FairQueue[str] = FairQueue(10)
    for i in range(3):
        queue.push(f"a{i}", tenant("a"))
    for i in range(2):
        queue.push(f"b{i}", tenant("b"))
    a0, from_back = queue.pop_end()
    b1, b_from_back = queue.pop_end(newest=True)
    assert (a0, from_back, b1, b_from_back) == ("a0", False, "b1", True)
    queue.put_back(b1, tenant("b"), at_back=True)  # in reverse order of the pops
    queue.put_back(a0, tenant("a"))
    assert len(queue) == 5
    # Each tenant's order is as before, and no turn is lost: the ring had moved on to b, so a's
    # missed turn comes with its next one (a0 and a1 together), as a deficit counter carries it.
    assert drain(queue) == ["b0", "a0", "a1", "b1", "a2"]
