"""The move at once to a scheduler with no worker of our model (issue 35: scheduler_endpoints.empty_target,
EmptySchedulerMove): only from two or more to none, confirmed by a jittered second look, never
reversing, never in a settled mesh. Pure logic on a fake clock."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from services.worker.scheduler_endpoints import (
    CONFIRM_MAX_S,
    CONFIRM_MIN_S,
    EmptySchedulerMove,
    EndpointLoad,
    LookAgain,
    MoveNow,
    empty_target,
    move_probability,
)
from tools.testbed.fake_clock import FakeClock

ADDRESSES = ("a:1", "b:1", "c:1")


def loads_of(*counts: int | None) -> list[EndpointLoad]:
    return [EndpointLoad(address, count) for address, count in zip(ADDRESSES, counts, strict=False)]


@pytest.mark.parametrize(
    ("mine", "other", "target"),
    [(2, 0, "b:1"), (5, 0, "b:1"), (1, 0, None), (2, 1, None), (3, 1, None), (0, 0, None), (None, 0, None),
     (2, None, None)],
)
def test_only_from_two_or_more_workers_to_a_scheduler_with_none(mine, other, target):
    assert empty_target(loads_of(mine, other), "a:1", "w") == target


def test_of_several_empty_schedulers_each_worker_has_its_own_first_and_keeps_it():
    loads = loads_of(4, 0, 0)
    targets = [empty_target(loads, "a:1", f"host:{pid}:x") for pid in range(200)]
    assert 60 < targets.count("b:1") < 140 and targets.count("a:1") == 0
    assert empty_target(loads, "a:1", "host:7:x") == empty_target(list(reversed(loads)), "a:1", "host:7:x")


def test_a_settled_mesh_never_moves():
    """Counts within one of each other (the stable mesh): neither rule moves anyone, from anywhere."""
    for counts in itertools.product(range(4), repeat=3):
        if max(counts) - min(counts) > 1:
            continue
        loads = loads_of(*counts)
        for current in ADDRESSES:
            assert empty_target(loads, current, "w") is None, counts
            assert move_probability(loads, current) == 0.0, counts


def test_a_move_never_empties_the_scheduler_it_leaves_nor_moves_the_worker_back():
    for counts in itertools.product(range(5), repeat=3):
        for index, current in enumerate(ADDRESSES):
            target = empty_target(loads_of(*counts), current, "w")
            if target is None:
                continue
            after = list(counts)
            after[index] -= 1
            after[ADDRESSES.index(target)] += 1
            assert after[index] >= 1 and after[ADDRESSES.index(target)] == 1
            assert empty_target(loads_of(*after), target, "w") is None, "nothing takes the mover back"


def test_the_first_look_asks_for_a_jittered_second_one_and_the_second_moves():
    clock = FakeClock()
    rule = EmptySchedulerMove("w", clock, random.Random(1))
    first = rule.look(loads_of(2, 0), "a:1")
    assert isinstance(first, LookAgain) and CONFIRM_MIN_S <= first.delay_s <= CONFIRM_MAX_S
    clock.advance(first.delay_s / 2)
    early = rule.look(loads_of(2, 0), "a:1")
    assert isinstance(early, LookAgain) and early.delay_s == pytest.approx(first.delay_s / 2)
    clock.advance(first.delay_s / 2)
    assert rule.look(loads_of(2, 0), "a:1") == MoveNow("b:1")
    assert isinstance(rule.look(loads_of(2, 0), "a:1"), LookAgain), "after a move the next sighting starts afresh"


def test_no_move_when_the_empty_scheduler_was_filled_before_the_second_look():
    clock = FakeClock()
    rule = EmptySchedulerMove("w", clock, random.Random(2))
    first = rule.look(loads_of(2, 0), "a:1")
    assert isinstance(first, LookAgain)
    clock.advance(first.delay_s)
    assert rule.look(loads_of(1, 1), "a:1") is None  # another worker of ours got there first
    assert isinstance(rule.look(loads_of(2, 0), "a:1"), LookAgain), "a new sighting waits for its own confirmation"


def test_the_confirming_delays_are_spread_so_workers_seeing_the_same_empty_scheduler_look_apart():
    delays = []
    for seed in range(100):
        look = EmptySchedulerMove("w", FakeClock(), random.Random(seed)).look(loads_of(2, 0), "a:1")
        assert isinstance(look, LookAgain)
        delays.append(look.delay_s)
    assert min(delays) >= CONFIRM_MIN_S and max(delays) <= CONFIRM_MAX_S
    assert len({round(d, 3) for d in delays}) > 80


def _simulate(num_workers: int, seed: int, counted_out_after_s: float) -> list[int]:
    """`num_workers` on scheduler a, b restarted empty; each worker looks first after up to 0.5 s (the
    unsettled backoff's cap) and then as its rule says, or every 0.5 s; a worker that moves is counted
    out of a and into b `counted_out_after_s` later (its Draining on the way). The counts at the end."""
    rng = random.Random(seed)
    clock = FakeClock()
    where = ["a:1"] * num_workers
    rules = [EmptySchedulerMove(f"w{i}", clock, random.Random(rng.random())) for i in range(num_workers)]
    counted = {"a:1": num_workers, "b:1": 0}
    events: list[tuple[float, int, str, int]] = []
    order = itertools.count()
    for i in range(num_workers):
        heapq.heappush(events, (clock() + rng.uniform(0, 0.5), next(order), "look", i))
    while events:
        at_s, _, kind, i = heapq.heappop(events)
        clock.advance(at_s - clock())
        if clock() > 1010.0:
            break
        if kind == "arrive":
            counted["a:1"] -= 1
            counted["b:1"] += 1
            continue
        if where[i] != "a:1":
            continue
        look = rules[i].look([EndpointLoad(a, n) for a, n in counted.items()], "a:1")
        if isinstance(look, MoveNow):
            where[i] = look.target
            heapq.heappush(events, (clock() + counted_out_after_s, next(order), "arrive", i))
        else:
            delay_s = look.delay_s if isinstance(look, LookAgain) else 0.5
            heapq.heappush(events, (clock() + delay_s, next(order), "look", i))
    return [counted["a:1"], counted["b:1"]]


@pytest.mark.parametrize("num_workers", [2, 3, 5])
def test_of_the_workers_on_one_scheduler_one_moves_to_the_empty_one(num_workers):
    """Counted out at once (the scheduler reads the Draining before anyone looks again): exactly one moves."""
    for seed in range(50):
        assert _simulate(num_workers, seed, counted_out_after_s=0.0) == [num_workers - 1, 1], seed


def test_even_with_a_slow_count_two_workers_rarely_both_move():
    """Counted out only 20 ms after the decision (a loaded box): two workers both move now and then
    (both then on b, a empty: the same rule moves one back); at most a few runs in a hundred."""
    outcomes = [_simulate(2, seed, counted_out_after_s=0.02) for seed in range(200)]
    assert all(outcome in ([1, 1], [0, 2]) for outcome in outcomes)
    assert outcomes.count([0, 2]) <= 20
