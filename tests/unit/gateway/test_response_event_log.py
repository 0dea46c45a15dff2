"""A background stream's event log (services/gateway/fronts/response_event_log.py): read from any point,
followed as events come until the end, bounded by bytes with the oldest out first, and a reader asking
for a dropped event told so rather than handed a stream with a hole."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.fronts.response_event_log import EventLog, EventsGone


def _events(first: int, count: int, size: int = 10) -> list[tuple[int, bytes]]:
    return [(n, bytes([65 + n % 26]) * size) for n in range(first, first + count)]


def test_events_after_a_sequence_number_are_exactly_the_later_ones():
    log = EventLog(1000)
    log.extend(_events(0, 5))
    assert [n for n, _ in log.after(-1)] == [0, 1, 2, 3, 4]
    assert [n for n, _ in log.after(2)] == [3, 4]
    assert log.after(4) == [] and log.after(99) == []


def test_past_the_bound_the_oldest_events_go_and_asking_for_them_is_refused():
    log = EventLog(35)  # three events of 10 bytes fit, a fourth pushes the first out
    log.extend(_events(0, 5))
    assert (log.first_kept, log.num_bytes) == (2, 30)
    assert [n for n, _ in log.after(1)] == [2, 3, 4]
    with pytest.raises(EventsGone, match="no longer kept.*starting_after >= 1") as gone:
        log.after(0)
    assert gone.value.first_kept == 2


def test_one_event_larger_than_the_bound_is_not_kept_and_the_next_one_is():
    log = EventLog(15)
    log.extend(_events(0, 1, size=20))
    assert (log.first_kept, log.next_sequence, log.num_bytes) == (1, 1, 0)
    log.extend(_events(1, 1))
    assert [n for n, _ in log.after(0)] == [1]


def test_events_must_come_in_sequence_and_none_after_the_end():
    log = EventLog(100)
    with pytest.raises(ValueError, match="out of sequence"):
        log.extend(_events(1, 1))
    log.extend(_events(0, 1))
    log.close()
    with pytest.raises(ValueError, match="ended"):
        log.extend(_events(1, 1))
    with pytest.raises(ValueError, match="max_bytes"):
        EventLog(0)


async def test_a_follower_gets_every_event_once_as_it_comes_until_the_end():
    log = EventLog(1000)
    log.extend(_events(0, 2))
    seen: list[int] = []

    async def follow(starting_after: int) -> None:
        async for sequence, _ in log.follow(starting_after):
            seen.append(sequence)

    follower = asyncio.create_task(follow(0))
    await asyncio.sleep(0)
    log.extend(_events(2, 2))
    await asyncio.sleep(0)
    log.extend(_events(4, 1))
    log.close()
    await asyncio.wait_for(follower, 5)
    assert seen == [1, 2, 3, 4]


async def test_following_an_ended_log_from_its_last_event_ends_at_once():
    log = EventLog(1000)
    log.extend(_events(0, 3))
    log.close()
    assert [n async for n, _ in log.follow(2)] == []
    assert [n async for n, _ in log.follow(-1)] == [0, 1, 2]
