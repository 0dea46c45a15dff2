from __future__ import annotations

import pytest

from services.common.errors import ResourceExhausted
from services.common.priority import Priority
from services.gateway.admission.shedding import LoadShedder, SheddingConfig, ShedReason, ShedThresholds
from services.gateway.routing.pressure import PressureBoard, PressureReport

CRITICAL, STANDARD, SHEDDABLE = Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE


def report(model: str = "tinylm", *, critical_s=0.0, standard_s=0.0, sheddable_s=0.0, kv_usage=0.0,
           num_workers=1, **over):
    queue_s = {CRITICAL: critical_s, STANDARD: standard_s, SHEDDABLE: sheddable_s}
    return PressureReport(model=model, est_queue_time_s=queue_s, kv_usage=kv_usage, num_workers=num_workers, **over)


@pytest.fixture
def board(clock) -> PressureBoard:
    return PressureBoard(clock, max_report_age_s=5.0)


@pytest.fixture
def shedder(board) -> LoadShedder:
    config = SheddingConfig(
        queue_slo_s={CRITICAL: 0.5, STANDARD: 2.0, SHEDDABLE: 5.0},
        queue=ShedThresholds(0.5, 0.8),
        kv_usage=ShedThresholds(0.90, 0.97),
        gateway_in_flight=ShedThresholds(0.8, 0.9),
    )
    return LoadShedder(config, board)


def admitted(shedder: LoadShedder, utilization: float = 0.0) -> set[Priority]:
    return {p for p in Priority if shedder.decide("tinylm", p, utilization).admit}


def test_admits_everyone_without_pressure(shedder):
    assert admitted(shedder) == {CRITICAL, STANDARD, SHEDDABLE}


def test_sheds_sheddable_first_then_standard_as_critical_queue_grows(shedder, board):
    seen = []
    for critical_s in (0.1, 0.3, 0.45):  # 20%, 60%, 90% of critical's 0.5 s SLO
        board.update("a:1", [report(critical_s=critical_s)])
        seen.append(admitted(shedder))
    assert seen == [{CRITICAL, STANDARD, SHEDDABLE}, {CRITICAL, STANDARD}, {CRITICAL}]


def test_sheds_by_kv_usage_in_the_same_order(shedder, board):
    board.update("a:1", [report(kv_usage=0.92)])
    assert admitted(shedder) == {CRITICAL, STANDARD}
    board.update("a:1", [report(kv_usage=0.99)])
    assert admitted(shedder) == {CRITICAL}


def test_reserves_last_gateway_slots_for_critical(shedder):
    assert admitted(shedder, utilization=0.85) == {CRITICAL, STANDARD}
    assert admitted(shedder, utilization=0.95) == {CRITICAL}


def test_critical_is_shed_only_when_it_would_miss_its_slo_anyway(shedder, board):
    board.update("a:1", [report(critical_s=0.6, standard_s=3.0, sheddable_s=9.0, kv_usage=1.0)])
    decision = shedder.decide("tinylm", CRITICAL, 1.0)
    assert not decision.admit and decision.reason is ShedReason.OVER_SLO
    board.update("a:1", [report(critical_s=0.49, kv_usage=1.0)])
    assert shedder.decide("tinylm", CRITICAL, 1.0).admit


def test_shed_error_carries_retry_hint_from_queue_time(shedder, board):
    board.update("a:1", [report(critical_s=0.3, sheddable_s=1.5)])
    with pytest.raises(ResourceExhausted) as info:
        shedder.check("tinylm", SHEDDABLE, 0.0)
    assert info.value.retry_after_s == pytest.approx(1.5)
    assert info.value.message == (
        "overloaded: shedding sheddable traffic for model 'tinylm' "
        "(critical queue time 0.300 s of its 0.5 s SLO); retry after 1.50 s"
    )


def test_retry_hint_is_clamped(shedder, board):
    board.update("a:1", [report(critical_s=0.3)])
    assert shedder.decide("tinylm", SHEDDABLE, 0.0).retry_after_s == 0.1  # min hint
    board.update("a:1", [report(critical_s=0.3, sheddable_s=60.0)])
    assert shedder.decide("tinylm", SHEDDABLE, 0.0).retry_after_s == 10.0  # max hint


def test_ignores_stale_reports_and_admits(shedder, board, clock):
    board.update("a:1", [report(critical_s=0.45)])
    clock.advance(5.1)
    assert admitted(shedder) == {CRITICAL, STANDARD, SHEDDABLE}
    assert board.min_service_time_s("tinylm") == 0.0


def test_no_worker_anywhere_is_not_overload(shedder, board):
    # A roll: the draining scheduler's workers left, the restarted one's have not attached yet; both
    # report the no-worker sentinel. The schedulers answer for themselves; nothing is shed for 10 s.
    board.update("a:1", [report(critical_s=3600.0, standard_s=3600.0, sheddable_s=3600.0, num_workers=0)])
    board.update("b:1", [report(critical_s=3600.0, standard_s=3600.0, sheddable_s=3600.0, num_workers=0)])
    assert admitted(shedder) == {CRITICAL, STANDARD, SHEDDABLE}
    board.update("b:1", [report(critical_s=0.45, num_workers=1)])
    assert admitted(shedder) == {CRITICAL}, "with a worker somewhere, its queue counts again"


def test_sheds_only_when_every_scheduler_is_under_pressure(shedder, board):
    board.update("a:1", [report(critical_s=0.45)])
    board.update("b:1", [report(critical_s=0.05)])
    assert admitted(shedder) == {CRITICAL, STANDARD, SHEDDABLE}


def test_pressure_from_proto_fields_is_indexed_by_priority_number(board):
    board.update(
        "a:1",
        [PressureReport.from_fields("tinylm", [0, 100_000, 400_000, 2_000_000], 7, 0.5, 2, 12_000)],
    )
    pressure = board.pressure("tinylm")
    assert pressure.est_queue_time_s == {CRITICAL: 0.1, STANDARD: 0.4, SHEDDABLE: 2.0}
    assert (pressure.queue_depth, pressure.kv_usage, pressure.num_workers) == (7, 0.5, 2)
    assert board.min_service_time_s("tinylm") == pytest.approx(0.012)
    assert board.pressure("digits") is None


def test_pressure_follows_reports_going_stale_one_endpoint_at_a_time(shedder, board, clock):
    board.update("a:1", [report(critical_s=0.05)])
    clock.advance(3.0)
    board.update("b:1", [report(critical_s=0.45)])
    assert admitted(shedder) == {CRITICAL, STANDARD, SHEDDABLE}  # a:1 still has room
    clock.advance(2.1)  # a:1's report is now 5.1 s old
    assert admitted(shedder) == {CRITICAL}
    clock.advance(3.0)
    assert admitted(shedder) == {CRITICAL, STANDARD, SHEDDABLE}  # nothing fresh: fail open
