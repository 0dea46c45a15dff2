"""What a draining scheduler waits for: classify calls and streams in flight, until they end or time is up."""

from __future__ import annotations

import asyncio

from services.scheduler.in_flight import InFlightCalls, idle, no_classify
from tests.support.fake_clock import FakeClock


async def test_wait_returns_when_the_last_call_ends():
    calls: InFlightCalls[str] = InFlightCalls(FakeClock())
    calls.classify_began()
    calls.stream_began("s1")
    waiting = asyncio.create_task(calls.wait_until(idle, timeout_s=60))
    await asyncio.sleep(0)
    calls.classify_ended()
    await asyncio.sleep(0)
    assert not waiting.done() and calls.streams == ["s1"]
    calls.stream_ended("s1")
    assert await waiting is True


async def test_classify_alone_may_be_waited_for_while_streams_run_on():
    calls: InFlightCalls[str] = InFlightCalls(FakeClock())
    calls.stream_began("s1")
    assert await calls.wait_until(no_classify, timeout_s=60) is True
    assert await calls.wait_until(idle, timeout_s=0) is False
    assert calls.num_streams == 1
