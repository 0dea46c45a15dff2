"""CallTable: ids, handlers and the deadline heap of one multiplexed stream, on a fake clock."""

from __future__ import annotations

import pytest

from services.gateway.upstream.call_table import CallTable


@pytest.fixture
def table(clock) -> CallTable[str]:
    return CallTable(clock)


def test_ids_start_at_one_and_are_never_reused(table):
    first = table.open("a", 1.0)
    table.pop(first)
    second = table.open("b", 1.0)
    assert (first, second) == (1, 2)
    assert table.get(first) is None and table.get(second) == "b"


def test_pop_returns_the_handler_once(table):
    call_id = table.open("a", 1.0)
    assert table.pop(call_id) == "a"
    assert table.pop(call_id) is None
    assert len(table) == 0


def test_rejects_a_call_with_no_time_left(table):
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        table.open("a", 0)


def test_pop_expired_takes_only_calls_past_their_deadline_earliest_first(table, clock):
    slow = table.open("slow", 2.0)
    fast = table.open("fast", 0.5)
    table.open("later", 5.0)
    clock.advance(0.49)
    assert table.pop_expired() == []
    clock.advance(1.6)
    assert table.pop_expired() == [(fast, "fast"), (slow, "slow")]
    assert len(table) == 1


def test_finished_calls_never_expire_and_the_next_deadline_skips_them(table, clock):
    first = table.open("a", 1.0)
    table.open("b", 3.0)
    table.pop(first)
    assert table.next_deadline_s() == clock.now_s + 3.0
    clock.advance(2.0)
    assert table.pop_expired() == []


def test_next_deadline_is_none_without_calls(table):
    assert table.next_deadline_s() is None
    table.pop(table.open("a", 1.0))
    assert table.next_deadline_s() is None


def test_dead_entries_are_compacted_and_live_deadlines_survive(table, clock):
    live = table.open("live", 100.0)
    for _ in range(1000):
        table.pop(table.open("short-lived", 10.0))
    assert len(table._deadlines) < 200, "the heap is rebuilt from the live calls"
    assert table.next_deadline_s() == clock.now_s + 100.0
    clock.advance(100.0)
    assert table.pop_expired() == [(live, "live")]


def test_pop_all_empties_the_table(table):
    a, b = table.open("a", 1.0), table.open("b", 2.0)
    assert sorted(table.pop_all()) == [(a, "a"), (b, "b")]
    assert len(table) == 0 and table.next_deadline_s() is None
