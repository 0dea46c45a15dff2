from __future__ import annotations

import pytest

from services.common.errors import DeadlineExceeded, Unavailable
from services.gateway.admission.concurrency import ConcurrencyLimiter
from services.gateway.dispatch.deadlines import DeadlinePolicy, Deadlines

# --------------------------------------------------------------------------- concurrency


def test_rejects_at_once_beyond_the_limit_and_admits_after_release():
    limiter = ConcurrencyLimiter(2, retry_after_s=0.05)
    first = limiter.acquire()
    limiter.acquire()
    with pytest.raises(Unavailable) as info:
        limiter.acquire()
    assert info.value.message == "gateway overloaded: 2 requests in flight (limit 2)"
    assert info.value.retry_after_s == 0.05
    assert limiter.utilization() == 1.0
    first.release()
    first.release()  # idempotent
    assert limiter.num_in_flight == 1
    with limiter.acquire():
        assert limiter.num_in_flight == 2
    assert limiter.num_in_flight == 1


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_in_flight must be >= 1, got 0"):
        ConcurrencyLimiter(0)


# --------------------------------------------------------------------------- deadlines


@pytest.fixture
def deadlines(clock) -> Deadlines:
    return Deadlines(DeadlinePolicy(default_timeout_s=10.0, max_timeout_s=60.0, hop_margin_s=0.005), clock)


def test_applies_default_when_client_sets_no_deadline(deadlines, clock):
    assert deadlines.start(None).remaining_s(clock()) == pytest.approx(10.0)


def test_clamps_client_deadline_to_maximum(deadlines, clock):
    assert deadlines.start(3600.0).remaining_s(clock()) == pytest.approx(60.0)
    assert deadlines.start(2.0).remaining_s(clock()) == pytest.approx(2.0)


def test_rejects_already_expired_deadline(deadlines):
    with pytest.raises(DeadlineExceeded, match="^deadline already expired on arrival$"):
        deadlines.start(0.0)


def test_downstream_gets_remaining_minus_hop_margin(deadlines, clock):
    deadline = deadlines.start(1.0)
    clock.advance(0.3)
    assert deadlines.downstream_timeout_s(deadline) == pytest.approx(0.695)


def test_downstream_timeout_raises_once_only_the_margin_is_left(deadlines, clock):
    deadline = deadlines.start(1.0)
    clock.advance(0.996)
    with pytest.raises(DeadlineExceeded) as info:
        deadlines.downstream_timeout_s(deadline)
    assert info.value.message == "deadline exceeded: 4.0 ms left, 5.0 ms hop margin"


def test_rejects_early_when_remaining_is_below_min_service_time(deadlines, clock):
    deadline = deadlines.start(0.050)
    deadlines.check_can_finish(deadline, "digits", min_service_time_s=0.040)
    clock.advance(0.010)
    deadlines.check_can_finish(deadline, "digits", min_service_time_s=0.040)  # the model's probe
    with pytest.raises(DeadlineExceeded) as info:
        deadlines.check_can_finish(deadline, "digits", min_service_time_s=0.040)
    assert info.value.message == (
        "deadline too short for model 'digits': 40.0 ms left, estimated minimum service time 40.0 ms"
    )


def test_one_request_a_second_per_model_probes_a_service_time_estimate_that_refuses_everything(deadlines, clock):
    """The estimate is learned from served requests: refusing all of them would freeze it."""
    admitted = 0
    for _ in range(300):  # 3 s of 100 ms deadlines against a 150 ms estimate
        try:
            deadlines.check_can_finish(deadlines.start(0.100), "digits", min_service_time_s=0.150)
            admitted += 1
        except DeadlineExceeded:
            pass
        clock.advance(0.010)
    assert admitted == 3
    with pytest.raises(DeadlineExceeded, match="deadline exceeded|already expired|too short"):
        deadlines.check_can_finish(deadlines.start(0.004), "other", min_service_time_s=0.0)  # no time left at all


def test_policy_validates_its_fields():
    with pytest.raises(ValueError, match=r"max_timeout_s \(1.0\) must be >= default_timeout_s \(2.0\)"):
        DeadlinePolicy(default_timeout_s=2.0, max_timeout_s=1.0)
