"""A drain serves the calls grpc core still queues (services/common/call_backlog.py): it waits until no call has
been handed to a handler for a number of event-loop polls, or until its limit."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from services.common.call_backlog import serve_backlog
from services.common.request_decoding import RequestDecodingInterceptor
from tools.testbed.fake_clock import FakeClock


def backlog(clock: FakeClock, num_handed: list[int], **over):
    """serve_backlog over the counts in `num_handed`, one per read (the last one repeated), polling every 50 ms
    of a fake clock (each poll's sleep moves it)."""
    counts = iter(num_handed)
    last = [num_handed[0]]

    def read() -> int:
        last[0] = next(counts, last[0])
        return last[0]

    args = {"limit_s": 5.0, "poll_s": 0.05, "num_quiet_polls": 4, "clock": clock, "sleep": clock.sleep, **over}
    return serve_backlog(read, **args)


async def test_an_idle_server_is_quiet_after_four_polls():
    clock = FakeClock(autojump_turns=1)
    served = await backlog(clock, [7])
    assert served.quiet and served.num_calls == 0
    assert served.waited_s == pytest.approx(0.2)


async def test_waits_while_calls_are_handed_over_then_counts_them():
    clock = FakeClock(autojump_turns=1)
    served = await backlog(clock, [0, 3, 9, 10, 30, 31])
    assert served.quiet and served.num_calls == 31
    assert served.waited_s == pytest.approx(0.05 * (5 + 4))  # five polls saw handovers, four did not


async def test_a_handover_between_quiet_polls_starts_the_count_again():
    clock = FakeClock(autojump_turns=1)
    served = await backlog(clock, [0, 0, 0, 0, 1])
    assert served.quiet and served.num_calls == 1
    assert served.waited_s == pytest.approx(0.05 * (4 + 4))


async def test_gives_up_at_its_limit_while_calls_still_arrive():
    clock = FakeClock(autojump_turns=1)
    served = await backlog(clock, list(range(100)), limit_s=1.01)
    assert not served.quiet
    assert served.waited_s == pytest.approx(1.05)  # 21 polls of 50 ms, the first past the limit ends it
    assert served.num_calls == 22  # one more at each poll, and at the read that counts them


async def test_the_decoding_interceptor_counts_every_call_it_hands_on():
    handed = RequestDecodingInterceptor()
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    async def continuation(details):
        return handler

    async def unknown(details):
        return None

    details = SimpleNamespace(method="/infermesh.v1.Inference/Classify")
    for _ in range(3):
        assert (await handed.intercept_service(continuation, details)).unary_unary is not None
    assert await handed.intercept_service(unknown, details) is None
    assert handed.num_handed == 4
