"""A scheduler that goes silent with calls waiting on it: probed, and severed only when the probe
gets no answer either; its calls then fail with UNAVAILABLE (no pushback) so they fail over."""

from __future__ import annotations

import asyncio

import pytest

from infermesh.v1 import gateway_pb2, scheduler_pb2
from services.common import errors
from services.gateway.routing.replicas import Membership
from services.gateway.routing.silence_watch import SilenceWatch, may_sever
from services.gateway.upstream.attempt_error import AttemptError
from services.gateway.upstream.clients import UnaryCalls
from services.gateway.upstream.scheduler_stream import SchedulerStream
from services.gateway.upstream.status import UpstreamCode
from tests.unit.gateway.test_scheduler_stream import (
    TRACE,
    FakeSubmitCall,
    FakeTimers,
    classify_request,
    generate_request,
    settle,
)


@pytest.fixture
def stream_and_calls(clock):
    calls: list[FakeSubmitCall] = []

    def open_call() -> FakeSubmitCall:
        calls.append(FakeSubmitCall())
        return calls[-1]

    stream = SchedulerStream("sched:1", open_call, 4096, clock)
    stream._call_later = FakeTimers(clock).call_later
    return stream, calls


async def test_silence_counts_from_the_last_reply_and_a_severed_stream_fails_its_calls_over(clock, stream_and_calls):
    stream, calls = stream_and_calls
    classify = asyncio.create_task(stream.classify(classify_request(), 10.0, TRACE))
    generate = stream.generate(generate_request(), 10.0, TRACE)
    await settle()
    clock.advance(0.2)
    assert stream.num_calls == 2 and stream.silent_for_s() == pytest.approx(0.2)
    calls[0].reply()  # an empty batch still shows the scheduler is there
    await settle()
    assert stream.silent_for_s() == 0.0

    assert stream.sever("scheduler sched:1 stopped answering") == 2
    with pytest.raises(AttemptError) as failed:
        await classify
    assert (failed.value.code, failed.value.pushback_ms) == (UpstreamCode.UNAVAILABLE, None)
    assert failed.value.endpoint_gone, "the dispatcher fails it over outside the retry budget"
    assert "stopped answering" in failed.value.error.message
    with pytest.raises(AttemptError):
        async for _ in generate.chunks():
            pass
    assert calls[0].cancelled and stream.num_calls == 0
    assert stream.sever("again") == 0, "nothing left to sever"


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_unary_calls_severed_end_unavailable_and_others_keep_their_own_error(clock):
    calls = UnaryCalls(clock)
    clock.advance(5)
    first = calls.add(FakeCall())
    assert calls.silent_for_s() == 0.0, "silence counts from when there is something to hear"
    clock.advance(1)
    second = calls.add(FakeCall())
    assert calls.silent_for_s() == 1.0
    assert calls.sever("scheduler a:1 stopped answering") == 2
    assert first.cancelled and second.cancelled
    severed = calls.severed(first)
    assert severed.code == UpstreamCode.UNAVAILABLE and severed.error.message == "scheduler a:1 stopped answering"
    calls.done(first)
    calls.done(second)
    third = calls.add(FakeCall())
    assert calls.severed(third) is None, "a call the client cancelled is not turned into a failover"


class FakeClient:
    def __init__(self, address: str, answer: Exception | None, silent: bool = True) -> None:
        self.address = address
        self._answer = answer
        self.silent = silent
        self.severed: list[tuple[float, str]] = []
        self.probes: list[float] = []

    def is_silent(self, silent_s: float) -> bool:
        return self.silent

    async def get_pressure(self, timeout_s: float):
        self.probes.append(timeout_s)
        if self._answer is not None:
            raise self._answer
        return object()

    def sever_if_silent(self, silent_s: float, why: str) -> int:
        self.severed.append((silent_s, why))
        return 3 if self.silent else 0


class FakeClients:
    def __init__(self, *clients: FakeClient) -> None:
        self._clients = list(clients)

    def clients(self) -> list[FakeClient]:
        return self._clients


def _timeout() -> AttemptError:
    return AttemptError.local(UpstreamCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


async def test_a_silent_scheduler_whose_probe_times_out_is_severed_and_demoted():
    client = FakeClient("a:1", _timeout())
    membership = Membership(lambda: ("a:1", "b:1"))
    watch = SilenceWatch(FakeClients(client), membership, silent_s=0.3, probe_timeout_s=0.3)
    assert await watch.probe(client) == 3
    assert client.probes == [0.3]
    assert client.severed == [(0.6, "scheduler a:1 stopped answering: nothing received for 0.6 s with calls "
                                    "waiting, and a probe got no answer in 0.3 s")]
    assert not membership.reachable("a:1")


@pytest.mark.parametrize("answer", [None, AttemptError(errors.Unavailable("connection refused"),
                                                       UpstreamCode.UNAVAILABLE, None)], ids=["answers", "refused"])
async def test_a_scheduler_that_answers_the_probe_or_refuses_it_is_not_severed(answer):
    client = FakeClient("a:1", answer)
    membership = Membership(lambda: ("a:1",))
    watch = SilenceWatch(FakeClients(client), membership, silent_s=0.3, probe_timeout_s=0.3)
    assert await watch.probe(client) == 0
    assert client.severed == [] and membership.reachable("a:1")


async def test_nothing_is_probed_or_severed_without_another_scheduler_to_fail_over_to():
    client = FakeClient("a:1", _timeout())
    membership = Membership(lambda: ("a:1", "b:1"))
    membership.unreachable("b:1")
    watch = SilenceWatch(FakeClients(client), membership, silent_s=0.3, probe_timeout_s=0.3)
    watch.check()
    await settle()
    assert client.probes == []
    assert await watch.probe(client) == 0 and client.severed == []


@pytest.mark.parametrize("live", [("a:1",), ("a:1", "b:1")], ids=["only scheduler", "other one silent too"])
async def test_with_the_hold_on_the_last_silent_scheduler_is_severed_too(live):
    client = FakeClient("a:1", _timeout())
    membership = Membership(lambda: live)
    if "b:1" in live:
        membership.unreachable("b:1")  # frozen too, severed before
    watch = SilenceWatch(FakeClients(client), membership, silent_s=0.3, probe_timeout_s=0.3, hold_on=True)
    watch.check()
    await settle()
    assert client.probes == [0.3]
    assert len(client.severed) == 1, "its calls go to the hold: a poll answer wakes them"
    assert not membership.reachable("a:1")


def test_may_sever_needs_membership_and_somewhere_for_the_calls_to_go():
    membership = Membership(lambda: ("a:1", "b:1"))
    assert may_sever(membership, "a:1", hold_on=False)
    membership.unreachable("b:1")
    assert not may_sever(membership, "a:1", hold_on=False), "the calls would only come back to a:1"
    assert may_sever(membership, "a:1", hold_on=True), "they wait in the hold"
    assert not may_sever(None, "a:1", hold_on=True), "nothing would demote it"


class StreamClient:
    """A scheduler client over a real SchedulerStream on the fake clock whose probes time out (frozen)."""

    def __init__(self, address: str, stream: SchedulerStream, clock) -> None:
        self.address = address
        self.stream = stream
        self.probes = 0
        self._clock = clock

    def is_silent(self, silent_s: float) -> bool:
        return self.stream.num_calls > 0 and self.stream.silent_for_s() >= silent_s

    async def get_pressure(self, timeout_s: float):
        self.probes += 1
        self._clock.advance(timeout_s)
        raise _timeout()

    def sever_if_silent(self, silent_s: float, why: str) -> int:
        return self.stream.sever(why) if self.is_silent(silent_s) else 0


async def test_a_frozen_only_scheduler_is_severed_after_silence_and_its_late_answers_reach_no_one(
        clock, stream_and_calls):
    stream, calls = stream_and_calls
    client = StreamClient("sched:1", stream, clock)
    membership = Membership(lambda: ("sched:1",))
    watch = SilenceWatch(FakeClients(client), membership, silent_s=0.3, probe_timeout_s=0.3, hold_on=True)
    classify = asyncio.create_task(stream.classify(classify_request(), 10.0, TRACE))
    await settle()
    clock.advance(0.25)
    watch.check()
    await settle()
    assert client.probes == 0 and not classify.done(), "not silent for long enough yet"
    clock.advance(0.1)
    watch.check()
    await settle()
    assert client.probes == 1
    with pytest.raises(AttemptError) as failed:
        await classify
    assert failed.value.scheduler_silent and failed.value.endpoint_gone, "re-dispatched, or held"
    assert calls[0].cancelled and not membership.reachable("sched:1")

    # The re-dispatched call goes out on a new stream; the frozen one wakes and answers the old call.
    again = asyncio.create_task(stream.classify(classify_request(), 10.0, TRACE))
    await settle()
    calls[0].reply(scheduler_pb2.CallReply(call_id=1, classify=gateway_pb2.ClassifyResponse(request_id="late")))
    await settle()
    assert not again.done(), "the severed stream is no longer read: its late answer reaches no call"
    (entry,) = calls[1].entries()
    calls[1].reply(scheduler_pb2.CallReply(call_id=entry.call_id,
                                           classify=gateway_pb2.ClassifyResponse(request_id="again")))
    assert (await again).request_id == "again"
    assert stream.num_calls == 0


async def test_check_probes_only_silent_clients_and_one_probe_at_a_time():
    silent, busy = FakeClient("a:1", _timeout()), FakeClient("b:1", None, silent=False)
    watch = SilenceWatch(FakeClients(silent, busy), Membership(lambda: ("a:1", "b:1")), silent_s=0.3,
                         probe_timeout_s=0.3)
    watch.check()
    watch.check()  # the first probe has not finished: no second one
    await settle()
    assert silent.probes == [0.3] and busy.probes == []
    watch.check()  # done: a still-silent client is probed again
    await settle()
    assert silent.probes == [0.3, 0.3]


async def test_an_idle_stream_is_not_silent_the_moment_a_call_arrives(clock, stream_and_calls):
    stream, calls = stream_and_calls
    first = asyncio.create_task(stream.classify(classify_request(), 10.0, TRACE))
    await settle()
    first.cancel()  # abandoned: the stream stays open with nothing in flight
    await settle()
    clock.advance(60)
    asyncio.create_task(stream.classify(classify_request(), 10.0, TRACE))
    await settle()
    assert stream.num_calls == 1 and stream.silent_for_s() == 0.0
    clock.advance(0.4)
    assert stream.silent_for_s() == pytest.approx(0.4)
    stream.sever("test over")
