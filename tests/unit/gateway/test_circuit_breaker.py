from __future__ import annotations

import pytest

from services.gateway.routing.circuit_breaker import (
    BreakerConfig,
    BreakerState,
    CircuitBreaker,
    CircuitBreakers,
)
from services.gateway.upstream.status import UpstreamCode


def make_breaker(clock, **over) -> CircuitBreaker:
    config = BreakerConfig(
        **{
            "num_consecutive_failures_to_open": 3,
            "error_rate_to_open": 0.5,
            "error_rate_window_s": 10.0,
            "min_calls_in_window": 10,
            "open_cooldown_s": 5.0,
            "num_half_open_probes": 1,
            **over,
        }
    )
    return CircuitBreaker("sched-a:50052", config, clock)


def fail(breaker: CircuitBreaker, times: int = 1) -> None:
    for _ in range(times):
        breaker.try_acquire().failure()


def succeed(breaker: CircuitBreaker, times: int = 1) -> None:
    for _ in range(times):
        breaker.try_acquire().success()


def test_opens_after_consecutive_failures_and_fails_fast(clock):
    breaker = make_breaker(clock)
    fail(breaker, 2)
    assert breaker.state is BreakerState.CLOSED
    fail(breaker)
    assert breaker.state is BreakerState.OPEN
    assert breaker.try_acquire() is None
    assert not breaker.is_available()
    clock.advance(2.0)
    assert breaker.retry_after_s() == pytest.approx(3.0)


def test_success_resets_the_consecutive_count(clock):
    breaker = make_breaker(clock)
    fail(breaker, 2)
    succeed(breaker)
    fail(breaker, 2)
    assert breaker.state is BreakerState.CLOSED


def test_opens_on_error_rate_over_the_window(clock):
    breaker = make_breaker(clock, num_consecutive_failures_to_open=100)
    for _ in range(5):  # alternating: never 2 in a row, but 50% errors
        succeed(breaker)
        assert breaker.state is BreakerState.CLOSED
        fail(breaker)
    assert breaker.state is BreakerState.OPEN


def test_error_rate_needs_a_minimum_number_of_calls(clock):
    breaker = make_breaker(clock, num_consecutive_failures_to_open=100, min_calls_in_window=10)
    succeed(breaker)
    fail(breaker, 4)  # 80% errors over 5 calls: too few to judge
    assert breaker.state is BreakerState.CLOSED


def test_old_errors_leave_the_window(clock):
    breaker = make_breaker(clock, num_consecutive_failures_to_open=100)
    for _ in range(4):
        succeed(breaker)
        fail(breaker)
    clock.advance(11.0)
    succeed(breaker, 9)
    fail(breaker)  # 1 of 10 in the window
    assert breaker.state is BreakerState.CLOSED


def test_half_open_after_cooldown_lets_limited_probes_through(clock):
    breaker = make_breaker(clock, num_half_open_probes=1)
    fail(breaker, 3)
    clock.advance(5.0)
    assert breaker.state is BreakerState.HALF_OPEN
    probe = breaker.try_acquire()
    assert probe is not None and probe.is_probe
    assert breaker.try_acquire() is None  # only one probe at a time
    assert breaker.retry_after_s() == 0.0


def test_probe_success_closes(clock):
    breaker = make_breaker(clock)
    fail(breaker, 3)
    clock.advance(5.0)
    breaker.try_acquire().success()
    assert breaker.state is BreakerState.CLOSED
    fail(breaker, 2)  # counts start afresh after closing
    assert breaker.state is BreakerState.CLOSED


def test_probe_failure_reopens_for_another_cooldown(clock):
    breaker = make_breaker(clock)
    fail(breaker, 3)
    clock.advance(5.0)
    breaker.try_acquire().failure()
    assert breaker.state is BreakerState.OPEN
    clock.advance(4.9)
    assert breaker.state is BreakerState.OPEN
    clock.advance(0.1)
    assert breaker.state is BreakerState.HALF_OPEN


def test_abandoned_probe_frees_its_slot_without_a_verdict(clock):
    breaker = make_breaker(clock)
    fail(breaker, 3)
    clock.advance(5.0)
    breaker.try_acquire().record(UpstreamCode.CANCELLED)
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.try_acquire() is not None


def test_late_outcome_of_a_call_from_before_the_trip_is_ignored(clock):
    breaker = make_breaker(clock)
    slow_call = breaker.try_acquire()  # started while CLOSED
    fail(breaker, 3)
    clock.advance(5.0)
    probe = breaker.try_acquire()
    slow_call.success()  # must not count as the probe's verdict
    assert breaker.state is BreakerState.HALF_OPEN
    probe.failure()
    assert breaker.state is BreakerState.OPEN


@pytest.mark.parametrize(
    ("code", "counts_as_failure"),
    [
        (UpstreamCode.UNAVAILABLE, True),
        (UpstreamCode.INTERNAL, True),
        (UpstreamCode.RESOURCE_EXHAUSTED, False),
        (UpstreamCode.DEADLINE_EXCEEDED, False),
        (UpstreamCode.INVALID_ARGUMENT, False),
        (UpstreamCode.OK, False),
    ],
)
def test_only_endpoint_faults_count_as_failures(clock, code, counts_as_failure):
    breaker = make_breaker(clock)
    for _ in range(3):
        breaker.try_acquire().record(code)
    assert (breaker.state is BreakerState.OPEN) is counts_as_failure


def test_registry_keeps_one_breaker_per_endpoint(clock):
    breakers = CircuitBreakers(BreakerConfig(num_consecutive_failures_to_open=1), clock)
    breakers.for_endpoint("a:1").try_acquire().failure()
    assert breakers.for_endpoint("a:1") is breakers.for_endpoint("a:1")
    assert breakers.states() == {"a:1": BreakerState.OPEN}
    assert breakers.for_endpoint("b:1").state is BreakerState.CLOSED


def test_an_answered_poll_lets_an_open_breaker_probe_at_once(clock):
    from services.gateway.routing.circuit_breaker import BreakerConfig, BreakerState, CircuitBreaker
    from services.gateway.upstream.status import UpstreamCode

    breaker = CircuitBreaker("a:1", BreakerConfig(num_consecutive_failures_to_open=1, open_cooldown_s=5), clock)
    breaker.try_acquire().record(UpstreamCode.UNAVAILABLE)
    assert breaker.state is BreakerState.OPEN
    breaker.answered_poll()
    assert breaker.state is BreakerState.HALF_OPEN, "a restarted scheduler is tried again before the cool-down"
    breaker.try_acquire().success()
    assert breaker.state is BreakerState.CLOSED
    breaker.answered_poll()
    assert breaker.state is BreakerState.CLOSED, "a closed breaker is left alone"
