"""What a draining scheduler waits for: classify calls and streams in flight, woken as each ends."""

from __future__ import annotations

import asyncio

from services.scheduler.in_flight import InFlightCalls, draining_error, idle


async def test_a_waiter_wakes_when_a_call_ends_and_idle_means_nothing_in_flight():
    calls: InFlightCalls[str] = InFlightCalls()
    calls.classify_began()
    calls.stream_began("s1")
    waiting = asyncio.create_task(calls.changed(timeout_s=60))
    await asyncio.sleep(0)
    calls.classify_ended()
    await asyncio.wait_for(waiting, 5)
    assert not idle(calls) and calls.streams == ["s1"]
    calls.stream_ended("s1")
    assert idle(calls)


async def test_changed_returns_after_its_timeout_when_nothing_ends():
    calls: InFlightCalls[str] = InFlightCalls()
    calls.stream_began("s1")
    await asyncio.wait_for(calls.changed(timeout_s=0), 5)
    assert calls.num_streams == 1


def test_the_draining_status_is_unavailable_with_pushback_zero():
    error = draining_error("stream handed over")
    assert (error.message, error.retry_after_s) == ("scheduler draining: stream handed over", 0.0)
