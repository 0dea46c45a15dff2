"""Which scheduler a worker attaches to: DNS endpoints (the --scheduler-address syntax: tests/unit/common/test_scheduler_address.py), the dial
order (fewest workers of the model first, ties spread by worker id, the scheduler just left last),
and the attach loop's re-dial at once after a session versus backoff when none took it."""

from __future__ import annotations

import random

import pytest

from services.common.scheduler_address import parse_scheduler_address
from services.worker.attach_client import MIN_SESSION_S, UNSETTLED_MAX_S, AttachClient, Backoff
from services.worker.scheduler_endpoints import (
    CONFIRM_MAX_S,
    EndpointLoad,
    dial_order,
    is_unsettled,
    move_probability,
    resolve,
)
from tools.testbed.fake_clock import FakeClock


async def test_dns_endpoints_are_every_distinct_record_ipv6_bracketed():
    asked = []

    async def resolver(name, port):
        asked.append((name, port))
        return ["10.0.0.1", "fd00::2", "10.0.0.1"]

    endpoints = parse_scheduler_address("dns:///sched:7000")
    assert await resolve(endpoints, resolver) == ["10.0.0.1:7000", "[fd00::2]:7000"]
    assert await resolve(parse_scheduler_address("a:1,b:2"), resolver) == ["a:1", "b:2"]
    assert asked == [("sched", 7000)]


def test_dials_the_scheduler_with_fewest_workers_of_the_model_first_and_skips_silent_ones():
    loads = [EndpointLoad("a:1", 2), EndpointLoad("b:1", None), EndpointLoad("c:1", 0), EndpointLoad("d:1", 1)]
    assert dial_order(loads, "worker-1") == ["c:1", "d:1", "a:1"]


def test_the_scheduler_just_left_goes_last_even_with_fewest_workers():
    loads = [EndpointLoad("a:1", 0), EndpointLoad("b:1", 3)]
    assert dial_order(loads, "worker-1", avoid="a:1") == ["b:1", "a:1"]


def test_ties_are_spread_over_the_schedulers_by_worker_id_and_stable_per_worker():
    loads = [EndpointLoad("a:1", 0), EndpointLoad("b:1", 0)]
    firsts = [dial_order(loads, f"host:{pid}:abc")[0] for pid in range(200)]
    assert 60 < firsts.count("a:1") < 140
    assert dial_order(loads, "host:7:abc") == dial_order(list(reversed(loads)), "host:7:abc")


@pytest.mark.parametrize(
    ("mine", "other", "probability"),
    [(2, 0, 0.5), (4, 0, 0.5), (3, 1, 1 / 3), (2, 1, 0.0), (1, 0, 0.0), (1, 3, 0.0), (None, 0, 0.0), (3, None, 0.0)],
)
def test_a_worker_moves_only_when_its_scheduler_has_two_more_workers_than_another(mine, other, probability):
    loads = [EndpointLoad("a:1", mine), EndpointLoad("b:1", other)]
    assert move_probability(loads, "a:1") == pytest.approx(probability)


def test_workers_deciding_alone_move_half_the_gap_on_average():
    rng = random.Random(3)
    loads = [EndpointLoad("a:1", 6), EndpointLoad("b:1", 0), EndpointLoad("c:1", 2)]
    p = move_probability(loads, "a:1")
    movers = [sum(rng.random() < p for _ in range(6)) for _ in range(2000)]
    assert sum(movers) / len(movers) == pytest.approx(3, abs=0.1)


class ScriptedDialer:
    def __init__(self, orders):
        self.orders = list(orders)
        self.avoided = []

    async def dial_order(self, avoid=None):
        self.avoided.append(avoid)
        return self.orders.pop(0) if self.orders else []


class CountingBackoff:
    def __init__(self):
        self.num_delays = 0

    def next_delay_s(self):
        self.num_delays += 1
        return 0.0

    def reset(self):
        pass


class ScriptedClient(AttachClient):
    """The attach loop with each session's outcome scripted: address -> attached (welcomed) or refused;
    an attached session lasts `session_s` on the fake clock."""

    def __init__(self, dialer, outcomes, stop_after, session_s=60.0):
        self.clock = FakeClock()
        super().__init__(dialer, runtime=None, worker_id="w", backoff=CountingBackoff(), clock=self.clock)
        self.outcomes = outcomes
        self.dialled = []
        self._stop_after = stop_after
        self._session_s = session_s

    async def _attach_to(self, address):
        self.dialled.append(address)
        if len(self.dialled) >= self._stop_after:
            self._stopping = True
        if self.outcomes[address]:
            self.clock.advance(self._session_s)
        return self.outcomes[address]


async def test_after_a_session_ends_the_worker_re_dials_at_once_another_scheduler_first():
    dialer = ScriptedDialer([["a:1", "b:1"], ["b:1", "a:1"]])
    client = ScriptedClient(dialer, {"a:1": True, "b:1": True}, stop_after=2)
    await client.run()
    client.close()
    assert client.dialled == ["a:1", "b:1"]
    assert dialer.avoided == [None, "a:1"]
    assert client._backoff.num_delays == 0


async def test_a_refusing_scheduler_is_passed_over_and_backoff_only_when_none_took_the_worker():
    dialer = ScriptedDialer([["a:1", "b:1"], [], ["b:1"]])
    client = ScriptedClient(dialer, {"a:1": False, "b:1": False}, stop_after=3)
    await client.run()
    client.close()
    assert client.dialled == ["a:1", "b:1", "b:1"]
    assert client._backoff.num_delays == 2  # after a round where both refused, and after a round with none


async def test_a_scheduler_dropping_workers_at_once_is_re_dialled_with_backoff_not_in_a_hot_loop():
    dialer = ScriptedDialer([["a:1"], ["a:1"], ["a:1"]])
    client = ScriptedClient(dialer, {"a:1": True}, stop_after=3, session_s=MIN_SESSION_S / 10)
    await client.run()
    client.close()
    assert client._backoff.num_delays == 2


async def test_a_worker_that_moved_off_to_an_empty_scheduler_re_dials_at_once_however_short_its_session():
    class MovingClient(ScriptedClient):
        async def _attach_to(self, address):
            self._moved = True  # as _hand_over leaves it
            return await super()._attach_to(address)

    dialer = ScriptedDialer([["a:1", "b:1"], ["b:1", "a:1"]])
    client = MovingClient(dialer, {"a:1": True, "b:1": True}, stop_after=2, session_s=MIN_SESSION_S / 10)
    await client.run()
    client.close()
    assert client.dialled == ["a:1", "b:1"]
    assert client._backoff.num_delays == 0


@pytest.mark.parametrize(
    ("mine", "other", "unsettled"),
    [(1, None, True), (2, 0, True), (3, 1, True), (1, 0, False), (2, 1, False), (1, 1, False), (0, 2, False)],
)
def test_a_missing_scheduler_or_a_due_move_is_looked_at_again_soon(mine, other, unsettled):
    loads = [EndpointLoad("a:1", mine), EndpointLoad("b:1", other)]
    assert is_unsettled(loads, "a:1") is unsettled


def test_rebalance_checks_are_under_half_a_second_while_a_scheduler_is_missing_then_back_to_the_interval():
    """Issue 35: a restarted scheduler served nothing for ~7 s because workers looked at the rebalance
    interval (2.5-7.5 s) alone; now they look every <= 0.5 s (jittered) while one is missing."""
    client = AttachClient("a:1", runtime=None, worker_id="w", backoff=Backoff(0.1, 0.5),
                          rebalance_interval_s=5.0, rng=random.Random(1))
    client._address = "a:1"
    missing = [EndpointLoad("a:1", 2), EndpointLoad("b:1", None)]
    back_empty = [EndpointLoad("a:1", 2), EndpointLoad("b:1", 0)]
    settled = [EndpointLoad("a:1", 1), EndpointLoad("b:1", 1)]
    soon = [client.next_rebalance_delay_s(missing) for _ in range(50)] + [client.next_rebalance_delay_s(back_empty)]
    assert max(soon) <= UNSETTLED_MAX_S
    assert len(set(soon)) > 40, "jittered, so workers do not probe in step"
    later = [client.next_rebalance_delay_s(settled) for _ in range(50)]
    assert min(later) >= 2.5 and max(later) <= 7.5
    assert client.next_rebalance_delay_s(missing) <= 0.05, "the backoff restarts once settled"
    client.close()


class LoadsDialer:
    has_choice = True

    def __init__(self, script, serving=True):
        self.script = list(script)
        self.looks = 0
        self.is_serving = serving
        self.asked_serving = []

    async def loads(self):
        self.looks += 1
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]

    async def dial_order(self, avoid=None):
        return []

    async def serving(self, address):
        self.asked_serving.append(address)
        return self.is_serving


class RecordingCall:
    """What the rebalance loop writes, when it half-closes (on the clock), and whether it cancels."""

    def __init__(self, clock):
        self.clock = clock
        self.written = []
        self.half_closed_at_s = None
        self.cancelled = False

    async def write(self, message):
        self.written.append(message)

    async def done_writing(self):
        self.half_closed_at_s = self.clock()

    def cancel(self):
        self.cancelled = True


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()

    async def fake_sleep(seconds):
        clock.advance(seconds)

    monkeypatch.setattr("services.worker.attach_client.asyncio.sleep", fake_sleep)
    return clock


async def test_a_worker_moves_to_a_restarted_scheduler_at_once_within_its_first_looks(clock):
    """The rebalance loop itself, on a fake clock: the other scheduler is missing for 10 looks, then back
    with no worker of ours while ours has 2: after a few sub-second looks (one to see it, one to confirm
    it) the worker says Draining with no grace and half-closes the stream (its sequences are resumed on
    the other worker here; it re-dials the empty one), not after a rebalance interval nor after its
    streams finish."""
    missing = [EndpointLoad("a:1", 2), EndpointLoad("b:1", None)]
    back = [EndpointLoad("a:1", 2), EndpointLoad("b:1", 0)]
    dialer = LoadsDialer([missing] * 10 + [back])
    client = AttachClient(dialer, runtime=None, worker_id="w", backoff=Backoff(0.1, 0.5), clock=clock,
                          rebalance_interval_s=5.0, rng=random.Random(7))
    client._address = "a:1"
    call = RecordingCall(clock)
    await client._rebalance(call)
    client.close()
    assert [m.WhichOneof("kind") for m in call.written] == ["draining"]
    assert call.written[0].draining.grace_ms == 0
    assert dialer.asked_serving == ["b:1"]
    looks_after_return = dialer.looks - 10
    assert 2 <= looks_after_return <= 8
    assert call.half_closed_at_s is not None
    assert call.half_closed_at_s - 1000.0 <= 10 * UNSETTLED_MAX_S + looks_after_return * CONFIRM_MAX_S
    assert client._leaving and client._moved
    assert call.cancelled, "a scheduler that never ends the stream after the half-close: cancelled (fake clock)"


async def test_no_move_to_an_empty_scheduler_that_is_not_serving(clock):
    """A draining scheduler answers GetPressure with no worker of ours too, but would refuse us: the
    worker stays (it looks again soon) and never half-closes."""

    class Enough(Exception):
        pass

    class CountingLoads(LoadsDialer):
        async def loads(self):
            if self.looks >= 12:
                raise Enough
            return await super().loads()

    dialer = CountingLoads([[EndpointLoad("a:1", 2), EndpointLoad("b:1", 0)]], serving=False)
    client = AttachClient(dialer, runtime=None, worker_id="w", backoff=Backoff(0.1, 0.5), clock=clock,
                          rebalance_interval_s=5.0, rng=random.Random(3))
    client._address = "a:1"
    call = RecordingCall(clock)
    with pytest.raises(Enough):
        await client._rebalance(call)
    client.close()
    assert call.written == [] and call.half_closed_at_s is None
    assert len(dialer.asked_serving) >= 4
    assert clock() - 1000.0 <= 12 * UNSETTLED_MAX_S, "it keeps looking soon, not at the interval"


async def test_no_move_when_the_last_look_before_leaving_finds_the_empty_scheduler_filled(clock):
    """Seen empty, confirmed, serving; but the look right before leaving counts another worker of ours
    gone there meanwhile: the worker stays."""

    class Enough(Exception):
        pass

    class Scripted(LoadsDialer):
        async def loads(self):
            if len(self.script) == 1 and self.looks >= 3:
                raise Enough
            return await super().loads()

    empty, filled = [EndpointLoad("a:1", 2), EndpointLoad("b:1", 0)], [EndpointLoad("a:1", 1), EndpointLoad("b:1", 1)]
    dialer = Scripted([empty, empty, filled])
    client = AttachClient(dialer, runtime=None, worker_id="w", backoff=Backoff(0.1, 0.5), clock=clock,
                          rebalance_interval_s=5.0, rng=random.Random(4))
    client._address = "a:1"
    call = RecordingCall(clock)
    with pytest.raises(Enough):
        await client._rebalance(call)
    client.close()
    assert dialer.asked_serving == ["b:1"]
    assert call.written == [] and call.half_closed_at_s is None and not client._moved


async def test_a_gap_to_a_scheduler_that_has_workers_is_still_closed_gracefully(clock):
    """3 workers here, 1 there: nothing is empty, so a move is the graceful one (Draining with the
    long grace, no half-close: the scheduler ends the stream when our streams are done)."""
    dialer = LoadsDialer([[EndpointLoad("a:1", 3), EndpointLoad("b:1", 1)]])
    client = AttachClient(dialer, runtime=None, worker_id="w", backoff=Backoff(0.1, 0.5), clock=clock,
                          rebalance_interval_s=5.0, rng=random.Random(5))
    client._address = "a:1"
    call = RecordingCall(clock)
    await client._rebalance(call)
    client.close()
    assert [m.WhichOneof("kind") for m in call.written] == ["draining"]
    assert call.written[0].draining.grace_ms == 60_000
    assert call.half_closed_at_s is None and not client._moved
    assert dialer.asked_serving == []
