"""Several schedulers: membership from ListModels, rendezvous affinity, spill on clear pressure, the breaker."""

from __future__ import annotations

from collections import Counter

from services.common.errors import Unavailable
from services.common.priority import Priority
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.pressure import PressureBoard, PressureReport
from services.gateway.routing.replicas import (
    Membership,
    ReplicaSelector,
    SpillPolicy,
    choose_replica,
    rendezvous_order,
)
from services.gateway.routing.table import RoutingTable
from services.gateway.upstream.status import UpstreamCode

A, B, C = "10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"


def _report(model="tinylm", queue_s=0.0, kv_usage=0.0, num_workers=1) -> PressureReport:
    return PressureReport(model, {p: queue_s for p in Priority}, kv_usage=kv_usage, num_workers=num_workers)


def _table(clock, live=(A, B), breakers=None):
    endpoints = list(live)
    membership = Membership(lambda: endpoints)
    board = PressureBoard(clock)
    breakers = breakers or CircuitBreakers(BreakerConfig(num_consecutive_failures_to_open=1), clock)
    table = RoutingTable((), breakers, replicas=ReplicaSelector(membership, board))
    return table, membership, board, breakers, endpoints


def test_rendezvous_order_is_stable_and_spreads_models_over_replicas():
    models = [f"model-{i}" for i in range(300)]
    preferred = Counter(rendezvous_order(m, [A, B, C])[0] for m in models)
    assert set(preferred) == {A, B, C} and min(preferred.values()) > 60, preferred
    assert all(rendezvous_order(m, [C, A, B]) == rendezvous_order(m, [A, B, C]) for m in models)


def test_losing_a_replica_moves_only_the_models_it_preferred():
    models = [f"model-{i}" for i in range(300)]
    before = {m: rendezvous_order(m, [A, B, C])[0] for m in models}
    after = {m: rendezvous_order(m, [A, B])[0] for m in models}
    assert all(after[m] == before[m] for m in models if before[m] != C)


def test_every_call_of_a_model_goes_to_its_preferred_replica(clock):
    table, *_ = _table(clock)
    preferred = rendezvous_order("tinylm", [A, B])[0]
    assert {table.choose("tinylm").endpoint for _ in range(20)} == {preferred}
    assert table.endpoints() == (A, B)


def test_membership_routes_only_to_replicas_serving_the_model_ready(clock):
    table, membership, *_ = _table(clock)
    membership.update(A, ["digits"])
    membership.update(B, ["tinylm"])
    assert table.choose("tinylm").endpoint == B
    assert table.choose("digits").endpoint == A
    assert table.model("digits").versions[0].endpoints[0].address == A


def test_a_model_no_replica_reports_ready_tries_every_live_one(clock):
    table, membership, *_ = _table(clock)
    membership.update(A, ["digits"])
    membership.update(B, [])
    assert table.choose("tinylm", exclude=frozenset({A})).endpoint == B
    assert table.choose("tinylm", exclude=frozenset({B})).endpoint == A


def test_with_the_serving_replicas_breaker_open_a_live_one_answers_instead(clock):
    # A roll: the restarted scheduler serves the model again, its breaker is open after connects refused
    # while its channel reconnected; the other one (draining, not serving) answers for itself.
    table, membership, _, breakers, _ = _table(clock)
    membership.update(A, ["tinylm"])
    membership.update(B, [])
    assert table.choose("tinylm").endpoint == A
    breakers.for_endpoint(A).try_acquire().record(UpstreamCode.UNAVAILABLE)
    assert table.choose("tinylm").endpoint == B, "not 'circuit open' while another scheduler is live"


def test_a_replica_whose_poll_failed_is_chosen_only_when_no_other_is_available(clock):
    table, membership, *_ = _table(clock)
    membership.update(A, ["tinylm"])
    membership.update(B, ["tinylm"])
    unreachable = rendezvous_order("tinylm", [A, B])[0]
    other = B if unreachable == A else A
    membership.unreachable(unreachable)
    assert membership.candidates("tinylm")[-1] == unreachable
    assert table.choose("tinylm").endpoint == other, "the preferred one is skipped while its poll fails"
    assert table.choose("tinylm", exclude=frozenset({other})).endpoint == unreachable, "but not left out"
    membership.update(unreachable, ["tinylm"])
    assert table.choose("tinylm").endpoint == unreachable, "it answers polls again: back to affinity"


def test_a_replica_gone_from_discovery_gets_no_new_calls(clock):
    table, membership, board, _, endpoints = _table(clock)
    preferred = rendezvous_order("tinylm", [A, B])[0]
    other = B if preferred == A else A
    endpoints.remove(preferred)
    membership.forget(preferred)
    assert {table.choose("tinylm").endpoint for _ in range(5)} == {other}
    assert table.endpoints() == (other,)


def test_spills_to_another_replica_only_when_the_preferred_is_clearly_busier(clock):
    table, _, board, *_ = _table(clock)
    preferred = rendezvous_order("tinylm", [A, B])[0]
    other = B if preferred == A else A
    board.update(preferred, [_report(queue_s=0.15)])
    board.update(other, [_report(queue_s=0.1)])
    assert table.choose("tinylm").endpoint == preferred, "1.5x and 50 ms more is not clearly busier"
    board.update(preferred, [_report(queue_s=0.5)])
    assert table.choose("tinylm").endpoint == other
    board.update(preferred, [_report(kv_usage=0.95)])
    assert table.choose("tinylm").endpoint == other, "a full KV cache spills"
    board.update(preferred, [_report(num_workers=0)])
    assert table.choose("tinylm").endpoint == other, "no workers left spills"


def test_stale_or_missing_pressure_never_spills(clock):
    table, _, board, *_ = _table(clock)
    preferred = rendezvous_order("tinylm", [A, B])[0]
    other = B if preferred == A else A
    board.update(preferred, [_report(queue_s=5.0)])
    board.update(other, [_report(queue_s=0.0)])
    clock.advance(board.max_report_age_s + 1)
    assert table.choose("tinylm").endpoint == preferred


def test_spill_compares_the_calls_own_priority():
    reports = {
        A: PressureReport("m", {Priority.CRITICAL: 0.0, Priority.STANDARD: 2.0, Priority.SHEDDABLE: 2.0}),
        B: PressureReport("m", {p: 0.5 for p in Priority}),
    }
    preferred = rendezvous_order("m", [A, B])[0]
    if preferred != A:
        reports[A], reports[B] = reports[B], reports[A]
    assert choose_replica("m", [A, B], reports.get, Priority.CRITICAL, SpillPolicy()) == preferred
    assert choose_replica("m", [A, B], reports.get, Priority.STANDARD, SpillPolicy()) != preferred


def test_the_breaker_takes_a_dead_replica_out(clock):
    table, *_ = _table(clock)
    preferred = table.choose("tinylm")
    preferred.permit.record(UpstreamCode.UNAVAILABLE)  # one failure opens it in this config
    other = table.choose("tinylm")
    assert other.endpoint != preferred.endpoint
    other.permit.record(UpstreamCode.UNAVAILABLE)
    try:
        table.choose("tinylm")
    except Unavailable as exc:
        assert "circuit open for all 2 endpoints" in exc.message
    else:
        raise AssertionError("every breaker is open: the call must fail fast")


def test_candidates_count_only_callable_endpoints(clock):
    table, *_ = _table(clock)
    assert _addresses(table.candidates("tinylm", "", frozenset({A}))) == [B]
    assert not table.candidates("tinylm", "", frozenset({A, B})).untried
    table.choose("tinylm", exclude=frozenset({A})).permit.record(UpstreamCode.UNAVAILABLE)
    assert not table.candidates("tinylm", "", frozenset({A})).untried, "B's breaker is open"


def test_candidates_follow_a_new_discovery_answer(clock):
    discovered = {"endpoints": (A,)}
    membership = Membership(lambda: discovered["endpoints"])
    membership.update(A, ["tinylm"])
    assert membership.candidates("tinylm") == (A,)
    discovered["endpoints"] = (A, B)  # discovery replaces its tuple on every change
    assert membership.candidates("tinylm") == (A, B), "B has not said it serves tinylm: only a fallback"
    membership.update(B, ["tinylm"])
    assert set(membership.candidates("tinylm")) == {A, B}
    membership.update(B, ["tinylm"])  # the same answer again changes nothing
    membership.unreachable(A)
    assert membership.candidates("tinylm") == (B, A)


def test_no_scheduler_discovered_yet_is_unavailable_with_a_hint(clock):
    table, *_ = _table(clock, live=())
    try:
        table.choose("tinylm")
    except Unavailable as exc:
        assert exc.message == "no scheduler known for model 'tinylm': discovery has found none yet"
        assert exc.retry_after_s == 1.0
    else:
        raise AssertionError("nothing to route to")
    assert not table.candidates("tinylm", "", frozenset()).untried


def test_a_model_served_only_by_unreachable_replicas_fails_open_to_every_live_one(clock):
    membership = Membership(lambda: (A, B))
    membership.update(A, ["tinylm"])
    membership.update(B, [])  # just restarted: its workers are re-attaching
    membership.unreachable(A)  # the scheduler that had them died
    assert membership.candidates("tinylm") == (B, A)


def _addresses(found) -> list[str]:
    return [e.address for e in found.untried]
