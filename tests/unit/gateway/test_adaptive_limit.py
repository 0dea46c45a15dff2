from __future__ import annotations

import pytest

from services.common.errors import ResourceExhausted
from services.common.priority import Priority
from services.gateway.admission.adaptive_limit import (
    AdaptiveLimit,
    AdaptiveLimitConfig,
    AdaptiveLimits,
    Outcome,
)
from tools.testbed.fake_clock import FakeClock

CRITICAL, STANDARD, SHEDDABLE = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def make_limit(clock: FakeClock | None = None, **over) -> AdaptiveLimit:
    # Windows close at their 20th event: run_windows' rounds of 20 requests are one window each.
    settings = dict(initial_limit=20, min_limit=2, max_limit=200, min_window_samples=20, min_window_s=0.001)
    settings.update(over)
    return AdaptiveLimit("digits", AdaptiveLimitConfig(**settings), clock or FakeClock())


def run_windows(limit: AdaptiveLimit, clock: FakeClock, *, num_windows: int, num_in_flight: int,
                latency_s: float, budget_s: float | None = 1.0, outcome: Outcome = Outcome.SUCCESS) -> None:
    """Each window: `num_in_flight` requests admitted together, all finishing after `latency_s`."""
    for _ in range(num_windows):
        permits = [limit.acquire(CRITICAL, budget_s) for _ in range(num_in_flight)]
        clock.advance(latency_s)
        for permit in permits:
            permit.done(outcome)
        clock.advance(0.06)


def test_refuses_at_once_beyond_the_class_share_with_a_retry_hint():
    limit = make_limit(initial_limit=10, min_limit=2)
    permits = [limit.acquire(SHEDDABLE, 1.0) for _ in range(6)]  # 0.6 x 10
    with pytest.raises(ResourceExhausted) as info:
        limit.acquire(SHEDDABLE, 1.0)
    assert info.value.message == (
        "overloaded: model 'digits' has 6 requests in flight, the adaptive limit for sheddable traffic is 6; "
        "retry after 0.02 s"
    )
    assert info.value.retry_after_s == 0.02
    permits += [limit.acquire(STANDARD, 1.0) for _ in range(3)]  # standard may fill 9
    with pytest.raises(ResourceExhausted, match="standard traffic is 9"):
        limit.acquire(STANDARD, 1.0)
    permits.append(limit.acquire(CRITICAL, 1.0))  # critical may fill all 10
    with pytest.raises(ResourceExhausted, match="critical traffic is 10"):
        limit.acquire(CRITICAL, 1.0)
    permits[0].done(Outcome.SUCCESS)
    permits[0].done(Outcome.SUCCESS)  # idempotent
    assert limit.num_in_flight == 9
    limit.acquire(CRITICAL, 1.0)


def test_grows_while_latency_holds_and_the_limit_is_what_holds_traffic_back():
    clock = FakeClock()
    limit = make_limit(clock)
    run_windows(limit, clock, num_windows=20, num_in_flight=20, latency_s=0.01)
    assert limit.limit > 35  # about 0.2 * sqrt(limit) per window


def test_keeps_its_limit_while_traffic_stays_below_half_of_it():
    clock = FakeClock()
    limit = make_limit(clock)
    run_windows(limit, clock, num_windows=10, num_in_flight=9, latency_s=0.01)
    assert limit.limit == 20


def test_shrinks_when_latency_climbs_past_the_tolerance_of_its_baseline():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=30)
    run_windows(limit, clock, num_windows=3, num_in_flight=20, latency_s=0.01)
    grown = limit.limit
    run_windows(limit, clock, num_windows=5, num_in_flight=20, latency_s=0.05)
    assert limit.limit < 0.8 * grown  # about x0.94 a window: half the limit plus sqrt headroom, smoothed


def test_backs_off_when_requests_use_more_than_the_late_fraction_of_their_deadline():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=30, tolerance=10.0)
    run_windows(limit, clock, num_windows=3, num_in_flight=20, latency_s=0.04, budget_s=0.1)
    before = limit.limit
    run_windows(limit, clock, num_windows=3, num_in_flight=20, latency_s=0.06, budget_s=0.1)  # > 50% of 100 ms
    assert limit.limit == pytest.approx(before * 0.9**3)


def test_upstream_refusals_as_too_late_back_off_and_ignored_outcomes_do_not_count():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=30)
    run_windows(limit, clock, num_windows=2, num_in_flight=20, latency_s=0.01, outcome=Outcome.DROPPED)
    assert limit.limit == pytest.approx(30 * 0.9**2)
    before = limit.limit
    run_windows(limit, clock, num_windows=3, num_in_flight=20, latency_s=5.0, outcome=Outcome.IGNORED)
    assert limit.limit == before
    assert limit.num_in_flight == 0


def test_never_leaves_its_bounds():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=4, min_limit=3, max_limit=8, min_window_samples=4)
    run_windows(limit, clock, num_windows=40, num_in_flight=limit.class_limit(CRITICAL), latency_s=0.01)
    assert limit.limit == 8
    run_windows(limit, clock, num_windows=40, num_in_flight=3, latency_s=0.01, outcome=Outcome.DROPPED)
    assert limit.limit == 3


def test_a_stream_is_sampled_at_its_first_response_not_at_its_end():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=20, min_window_samples=1)
    permit = limit.acquire(CRITICAL, 10.0)
    clock.advance(0.02)
    permit.first_response()
    assert limit.recent_s == pytest.approx(0.02)
    clock.advance(5.0)
    permit.done(Outcome.SUCCESS)
    assert limit.recent_s == pytest.approx(0.02)
    assert limit.num_in_flight == 0


def test_one_limit_per_model():
    limits = AdaptiveLimits(AdaptiveLimitConfig(initial_limit=4, min_limit=1), FakeClock())
    for _ in range(4):
        limits.for_model("a").acquire(CRITICAL, None)
    limits.for_model("b").acquire(CRITICAL, None)
    assert limits.for_model("a").num_in_flight == 4
    assert sorted(limits.limits()) == ["a", "b"]


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (dict(initial_limit=1, min_limit=2), "need 1 <= min_limit <= initial_limit <= max_limit"),
        (dict(tolerance=0.5), "tolerance must be >= 1"),
        (dict(backoff=0.0), r"backoff must be in \(0, 1\]"),
        (dict(share={CRITICAL: 1.0}), "share needs a fraction for every priority; missing standard, sheddable"),
    ],
)
def test_config_errors_are_precise(over, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveLimitConfig(**over)


def test_latency_growth_alone_never_takes_the_limit_below_the_slots():
    def settle(num_slots: int) -> float:
        clock = FakeClock()
        limit = make_limit(clock, initial_limit=40, min_window_samples=30)
        limit.num_slots = num_slots  # e.g. one worker of max batch 16, one batch running and one prefetched
        run_windows(limit, clock, num_windows=3, num_in_flight=30, latency_s=0.01)
        for _ in range(20):  # batching: latency grows with what is in flight
            num_in_flight = min(30, limit.class_limit(CRITICAL))
            run_windows(limit, clock, num_windows=1, num_in_flight=num_in_flight, latency_s=0.08)
            assert limit.limit >= min(40, num_slots)
        return limit.limit

    assert settle(num_slots=0) < 30 <= 32 <= settle(num_slots=32)


def test_the_deadline_signal_goes_below_the_slots_when_full_batches_are_too_slow():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=40, min_window_samples=4)
    limit.num_slots = 32
    run_windows(limit, clock, num_windows=10, num_in_flight=4, latency_s=0.06, budget_s=0.1)
    assert limit.limit == pytest.approx(40 * 0.9**10)


# -- tenants: a flood that fills the limit does not shut a light tenant out (issue 41's audit) --


def admit_until_refused(limit: AdaptiveLimit, priority: Priority, tenant_id: str, weight: int = 1) -> list:
    permits = []
    while True:
        try:
            permits.append(limit.acquire(priority, 1.0, tenant_id=tenant_id, weight=weight))
        except ResourceExhausted:
            return permits


def test_a_flood_holding_the_whole_class_limit_does_not_refuse_a_tenant_under_its_share():
    limit = make_limit(initial_limit=10)
    heavy = admit_until_refused(limit, STANDARD, "heavy")
    assert len(heavy) == 9  # standard may fill 9 of 10
    # Equal weights: light's share of the 9 is 4.5, so 4 permits over the limit.
    light = admit_until_refused(limit, STANDARD, "light")
    assert len(light) == 4 and limit.num_in_flight == 13
    with pytest.raises(ResourceExhausted, match="standard traffic is 9"):  # the flood stays refused
        limit.acquire(STANDARD, 1.0, tenant_id="heavy")
    for permit in heavy[:5]:
        permit.done(Outcome.SUCCESS)
    # 8 in flight: room for one more of anyone, then heavy (4) and light (4) hold their shares.
    limit.acquire(STANDARD, 1.0, tenant_id="heavy")
    with pytest.raises(ResourceExhausted):
        limit.acquire(STANDARD, 1.0, tenant_id="light")
    assert limit.num_held_by("heavy") == 5 and limit.num_held_by("light") == 4


def test_the_share_over_the_limit_follows_the_weights():
    limit = make_limit(initial_limit=12)
    heavy = admit_until_refused(limit, CRITICAL, "heavy", weight=1)
    assert len(heavy) == 12
    gold = admit_until_refused(limit, CRITICAL, "gold", weight=2)
    assert len(gold) == 8  # 2/3 of 12
    bronze = admit_until_refused(limit, CRITICAL, "bronze", weight=1)
    assert len(bronze) == 3  # 1/4 of 12
    assert limit.num_in_flight == 12 + 8 + 3  # over by at most the other tenants' shares


def test_fairness_is_inside_a_class_and_the_classes_keep_their_parts():
    limit = make_limit(initial_limit=10)
    admit_until_refused(limit, CRITICAL, "vip")
    # The critical tenant holds all 10; a standard tenant has no room to share, however light.
    with pytest.raises(ResourceExhausted, match="standard traffic is 9"):
        limit.acquire(STANDARD, 1.0, tenant_id="light")
    # A second critical tenant shares the critical part.
    assert len(admit_until_refused(limit, CRITICAL, "vip2")) == 5


def test_a_sheddable_flood_leaves_the_standard_tenants_what_their_part_leaves_them():
    limit = make_limit(initial_limit=10)
    admit_until_refused(limit, SHEDDABLE, "batch")  # sheddable fills 6
    assert len(admit_until_refused(limit, STANDARD, "web")) == 3  # standard fills 9: 3 are left
    # web2 shares those 3 with web: it gets one, over the limit, and web is the one refused.
    assert len(admit_until_refused(limit, STANDARD, "web2")) == 1
    assert len(admit_until_refused(limit, STANDARD, "web")) == 0


def test_one_tenant_alone_is_refused_exactly_as_before():
    limit = make_limit(initial_limit=10)
    assert len(admit_until_refused(limit, CRITICAL, "only")) == 10
    assert len(admit_until_refused(limit, CRITICAL, "only")) == 0


# -- held calls (gateway dispatch/hold.py): only the time a scheduler served is a sample ----------------


def run_outage_windows(limit: AdaptiveLimit, clock: FakeClock, *, num_windows: int, num_in_flight: int,
                       served_s: float, held_s: float, outcome: Outcome = Outcome.SUCCESS) -> None:
    """Each window: `num_in_flight` requests whose first attempt found no scheduler after 0.6 s (a
    silent one), then waited `held_s` in the hold, then were served in `served_s`."""
    for _ in range(num_windows):
        permits = [limit.acquire(CRITICAL, 10.0) for _ in range(num_in_flight)]
        for permit in permits:
            permit.attempt()
        clock.advance(0.6)
        for permit in permits:
            permit.unserved(from_attempt=True)
            permit.step_out()
        clock.advance(held_s)
        for permit in permits:
            permit.step_in()
            permit.attempt()
        clock.advance(served_s)
        for permit in permits:
            permit.done(outcome)
        clock.advance(0.06)


def test_time_no_scheduler_could_take_a_request_is_not_its_latency_sample():
    clock = FakeClock()
    limit = make_limit(clock)
    run_outage_windows(limit, clock, num_windows=1, num_in_flight=20, served_s=0.02, held_s=2.0)
    assert limit.recent_s == pytest.approx(0.02)


def test_after_a_long_outage_the_limit_is_where_it_was():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=30)
    run_windows(limit, clock, num_windows=5, num_in_flight=20, latency_s=0.02)
    before, baseline_s = limit.limit, limit.baseline_s
    # 20 windows of calls held 2 s each, served as fast as before. Before this each read as a 2.6 s
    # upstream: the limit fell from 36 to 19 within the outage, and the next request was refused.
    run_outage_windows(limit, clock, num_windows=20, num_in_flight=20, served_s=0.02, held_s=2.0)
    assert limit.limit >= before
    assert limit.baseline_s == pytest.approx(baseline_s)


def test_a_request_that_ends_with_no_scheduler_to_take_it_is_no_sample_at_all():
    clock = FakeClock()
    limit = make_limit(clock, initial_limit=30)
    for outcome in (Outcome.DROPPED, Outcome.SUCCESS):  # its deadline ran out in the hold; any outcome
        permits = [limit.acquire(CRITICAL, 3.0) for _ in range(20)]
        for permit in permits:
            permit.attempt()
            permit.unserved(from_attempt=True)
        clock.advance(2.9)
        for permit in permits:
            permit.done(outcome)
    assert limit.limit == 30 and limit.recent_s is None
    assert limit.num_in_flight == 0


def test_a_held_request_gives_its_slot_back_and_takes_it_again_past_the_limit():
    limit = make_limit(initial_limit=10)  # one tenant: no fair share to let anyone past the limit
    held = [limit.acquire(CRITICAL, 10.0) for _ in range(10)]
    with pytest.raises(ResourceExhausted):
        limit.acquire(CRITICAL, 10.0)
    for permit in held:
        permit.unserved()
        permit.step_out()
        permit.step_out()  # idempotent
    assert limit.num_in_flight == 0 and limit.num_held_by("") == 0
    new = [limit.acquire(CRITICAL, 10.0) for _ in range(10)]  # the hold's own cap bounds the held ones
    for permit in held:
        permit.step_in()
        permit.step_in()  # idempotent
    assert limit.num_in_flight == 20 and limit.num_held_by("") == 20
    with pytest.raises(ResourceExhausted):  # refused until the held calls' burst has drained
        limit.acquire(CRITICAL, 10.0)
    for permit in [*held, *new]:
        permit.done(Outcome.SUCCESS)
    assert limit.num_in_flight == 0
    limit.acquire(CRITICAL, 10.0)


def test_a_request_cancelled_while_held_releases_its_slot_once():
    limit = make_limit(initial_limit=10)
    permit = limit.acquire(CRITICAL, 10.0)
    permit.unserved()
    permit.step_out()
    permit.done(Outcome.IGNORED)  # the scope's exit, before the hold's step_in
    permit.step_in()
    assert limit.num_in_flight == 0 and limit.num_held_by("") == 0
