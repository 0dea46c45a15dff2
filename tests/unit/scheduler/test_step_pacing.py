"""StepPacing alone, on a fake clock: how many steps a pipelined loop sends ahead and when, what a
step took when its command's results came back together, and the wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.step_pacing import (
    COMMAND_LEAD_S,
    FIRST_AHEAD_AT,
    GATHER_GAP_AT,
    GATHER_MAX_AT,
    GATHER_MAX_S,
    StepPacing,
)
from tests.unit.scheduler.conftest import until_turns
from tools.testbed.fake_clock import FakeClock


def make_pacing(clock: FakeClock, steps_per_command: int = 4) -> StepPacing:
    return StepPacing(steps_per_command, clock, clock.sleep)


async def test_after_an_idle_spell_one_step_goes_ahead_until_the_first_result(clock):
    # Streams arriving together land ms apart: K steps behind the first one's made the rest wait K + 1.
    pacing = make_pacing(clock)
    assert pacing.steps_to_send(False, num_in_flight=1, last_command_size=1) == 1
    assert pacing.steps_to_send(False, num_in_flight=2, last_command_size=1) == 0
    pacing.on_result(clock(), 0, 1)
    assert pacing.steps_to_send(False, num_in_flight=1, last_command_size=1) == 4
    pacing.idle()
    assert pacing.steps_to_send(False, num_in_flight=1, last_command_size=1) == 1


async def test_after_an_idle_spell_the_step_behind_the_first_waits_into_it_by_the_last_step_time(clock):
    # Streams arriving a few ms behind the first share its next step instead of waiting one more.
    pacing = make_pacing(clock)
    sent_at_s = clock()
    clock.advance(0.040)
    pacing.on_result(sent_at_s, 0, 1)  # a step took 40 ms
    pacing.idle()
    pacing.sent(clock())
    assert pacing.steps_to_send(True, num_in_flight=1, last_command_size=1) == 0, "not at once, whoever waits"
    assert pacing.waits_on_more_than_results(last_command_size=1), "the timer wakes the loop"
    due = pacing.due()
    await asyncio.sleep(0)
    clock.advance(FIRST_AHEAD_AT * 0.040 - 0.0001)
    await asyncio.sleep(0)
    assert not due.done()
    clock.advance(0.0002)
    await until_turns(due.done)
    assert pacing.steps_to_send(True, num_in_flight=1, last_command_size=1) == 1
    assert pacing.steps_to_send(False, num_in_flight=2, last_command_size=1) == 0


async def test_the_first_result_ends_the_wait_for_the_step_behind_it(clock):
    pacing = make_pacing(clock)
    sent_at_s = clock()
    clock.advance(0.040)
    pacing.on_result(sent_at_s, 0, 1)
    pacing.idle()
    pacing.sent(clock())
    assert pacing.steps_to_send(False, num_in_flight=1, last_command_size=1) == 0
    clock.advance(0.010)  # a lone step, faster than the last one measured
    pacing.on_result(clock() - 0.010, 0, 1)
    assert not pacing.waits_on_more_than_results(last_command_size=1), "the timer was disarmed"
    assert pacing.steps_to_send(False, num_in_flight=1, last_command_size=1) == 4


async def gather_started(pacing: StepPacing) -> asyncio.Task[None]:
    """pacing.gather() running, its timer asleep on the fake clock."""
    gathering = asyncio.create_task(pacing.gather())
    for _ in range(5):
        await asyncio.sleep(0)
    return gathering


async def arrivals_3_ms_apart(pacing: StepPacing, clock: FakeClock, gathering: asyncio.Task[None],
                              until_s: float) -> float:
    """Arrivals 3 ms apart for as long as the next one lands before `until_s`, gather still waiting
    after each; the time they took."""
    arrivals_s = 0.0
    while arrivals_s + 0.003 < until_s:
        clock.advance(0.003)
        arrivals_s += 0.003
        pacing.wake()
        for _ in range(5):
            await asyncio.sleep(0)
        assert not gathering.done()
    return arrivals_s


def measured(pacing: StepPacing, clock: FakeClock, step_s: float) -> None:
    """A step of `step_s` seconds, then an idle spell."""
    sent_at_s = clock()
    clock.advance(step_s)
    pacing.on_result(sent_at_s, 0, 1)
    pacing.idle()


async def test_after_an_idle_spell_the_first_step_waits_while_sequences_keep_arriving(clock):
    pacing = make_pacing(clock)
    measured(pacing, clock, 0.040)
    gathering = await gather_started(pacing)
    arrivals_s = await arrivals_3_ms_apart(pacing, clock, gathering, GATHER_MAX_AT * 0.040)  # one every gap
    clock.advance(GATHER_MAX_AT * 0.040 - arrivals_s + 0.0001)  # no more than that in all
    await until_turns(gathering.done)


async def test_a_lone_arrival_waits_one_gap_for_company(clock):
    pacing = make_pacing(clock)
    measured(pacing, clock, 0.040)
    gathering = await gather_started(pacing)
    clock.advance(GATHER_GAP_AT * 0.040 - 0.0001)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not gathering.done()
    clock.advance(0.0002)
    await until_turns(gathering.done)


async def test_with_no_step_time_known_the_first_step_waits_for_nobody(clock):
    await asyncio.wait_for(make_pacing(clock).gather(), timeout=5)


async def test_a_step_a_stall_made_long_makes_the_first_step_wait_no_more_than_gather_max_s(clock):
    # The process was stopped for 5 s with a step in flight: its round trip is no step time to wait by.
    pacing = make_pacing(clock)
    measured(pacing, clock, 5.0)
    gathering = await gather_started(pacing)
    waited_s = await arrivals_3_ms_apart(pacing, clock, gathering, GATHER_MAX_S)  # they keep arriving
    clock.advance(GATHER_MAX_S - waited_s + 0.0001)
    await until_turns(gathering.done)


async def test_a_lone_arrival_after_a_long_step_waits_gather_max_s_at_most(clock):
    pacing = make_pacing(clock)
    measured(pacing, clock, 5.0)
    gathering = await gather_started(pacing)
    clock.advance(GATHER_MAX_S + 0.0001)
    await until_turns(gathering.done)


async def test_with_nobody_waiting_a_whole_command_goes_until_more_than_one_is_in_flight(clock):
    pacing = make_pacing(clock)
    pacing.on_result(clock(), 0, 1)  # past the first step after an idle spell
    assert pacing.steps_to_send(False, num_in_flight=1, last_command_size=1) == 4
    assert pacing.steps_to_send(False, num_in_flight=4, last_command_size=4) == 4  # no step time measured yet
    assert pacing.steps_to_send(False, num_in_flight=5, last_command_size=4) == 0


async def test_a_waiting_sequence_gets_one_step_right_behind_a_command_then_one_at_a_time(clock):
    pacing = make_pacing(clock)
    assert pacing.steps_to_send(True, num_in_flight=4, last_command_size=4) == 1
    assert pacing.steps_to_send(True, num_in_flight=1, last_command_size=1) == 1
    assert pacing.steps_to_send(True, num_in_flight=2, last_command_size=1) == 0


def test_steps_of_one_command_each_take_an_even_share_of_its_round_trip(clock):
    pacing = make_pacing(clock)
    sent_at_s = clock()
    clock.advance(0.008)
    first = pacing.on_result(sent_at_s, index_in_command=0, command_size=4)
    second = pacing.on_result(sent_at_s, index_in_command=1, command_size=4)
    assert first.share_s == second.share_s == first.took_s == pytest.approx(0.002)
    assert first.gap_s == 0.0


def test_a_step_sent_before_the_last_result_is_timed_from_that_result_with_no_gap(clock):
    pacing = make_pacing(clock)
    pacing.on_result(clock(), 0, 1)
    ahead_sent_at_s = clock() - 0.001  # sent while the step before it ran
    clock.advance(0.003)
    timing = pacing.on_result(ahead_sent_at_s, 0, 1)
    assert timing.took_s == pytest.approx(0.003) and timing.gap_s == 0.0 and timing.share_s is None
    sent_at_s = clock() + 0.0005  # the scheduler took 0.5 ms from that result to this send
    clock.advance(0.0025)
    assert pacing.on_result(sent_at_s, 0, 1).gap_s == pytest.approx(0.0005)


async def test_the_next_command_waits_until_one_step_and_the_lead_are_left_in_flight(clock):
    pacing = make_pacing(clock)
    sent_at_s = clock()
    clock.advance(0.008)
    pacing.on_result(sent_at_s, 0, 4)  # 2 ms a step
    # Three steps in flight end 6 ms from now; the next command is due 1 step and the lead before.
    assert pacing.steps_to_send(False, num_in_flight=3, last_command_size=4) == 0
    assert pacing.waits_on_more_than_results(last_command_size=1), "the timer wakes the loop"
    due = pacing.due()
    await asyncio.sleep(0)  # the timer starts sleeping on the fake clock
    clock.advance(0.004 - COMMAND_LEAD_S - 0.0001)
    await asyncio.sleep(0)
    assert not due.done()
    clock.advance(0.0002)
    await until_turns(due.done)
    assert pacing.steps_to_send(False, num_in_flight=3, last_command_size=4) == 4
    assert not pacing.waits_on_more_than_results(last_command_size=1), "the timer was disarmed"


async def test_an_arrival_makes_the_command_due_and_is_seen_once(clock):
    pacing = make_pacing(clock)
    due = pacing.due()
    pacing.wake()
    assert due.done()
    assert pacing.arrived()
    assert not pacing.arrived()


async def test_sleep_ends_on_wake_or_timeout(clock):
    pacing = make_pacing(clock)
    sleeper = asyncio.create_task(pacing.sleep(None))
    await asyncio.sleep(0)
    assert not sleeper.done()
    pacing.wake()
    await asyncio.wait_for(sleeper, timeout=5)
    await asyncio.wait_for(pacing.sleep(0.0), timeout=5)  # the fake clock's sleep(0) is one turn


async def test_sleep_times_out_when_the_injected_clock_passes_with_no_real_wait(clock):
    # One way to wait for an arrival or a timeout, gather's: the blocked loop's poll runs on the fake clock too.
    pacing = make_pacing(clock)
    sleeper = asyncio.create_task(pacing.sleep(60.0))
    for _ in range(5):
        await asyncio.sleep(0)
    clock.advance(60.0 - 0.001)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not sleeper.done()
    clock.advance(0.002)
    await until_turns(sleeper.done)
    assert not pacing.arrived(), "a timeout is no arrival"


async def test_an_arrival_ends_a_timed_sleep_at_once_and_its_timer_with_it(clock):
    pacing = make_pacing(clock)
    num_tasks = len(asyncio.all_tasks())
    sleeper = asyncio.create_task(pacing.sleep(60.0))
    await asyncio.sleep(0)
    pacing.wake()
    await until_turns(sleeper.done)
    await until_turns(lambda: len(asyncio.all_tasks()) == num_tasks)  # the timer was cancelled
    assert pacing.arrived()
