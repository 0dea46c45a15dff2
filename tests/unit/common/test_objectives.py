"""Latency objectives: per-class defaults, tenant and request overrides, bounds (common/objectives.py)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.objectives import (
    LatencyObjective,
    ObjectiveBounds,
    ObjectiveOverride,
    ObjectivePolicy,
    parse_objective_ms,
    request_override,
)
from services.common.priority import Priority

DEFAULTS = {Priority.CRITICAL: LatencyObjective(200.0, 50.0), Priority.STANDARD: LatencyObjective(1000.0, 100.0),
            Priority.SHEDDABLE: LatencyObjective(5000.0, 500.0)}
POLICY = ObjectivePolicy(DEFAULTS, ObjectiveBounds(min_ttft_ms=50, max_ttft_ms=60_000, min_tpot_ms=5, max_tpot_ms=2000))


def test_the_class_default_applies_when_nobody_sets_one():
    assert POLICY.resolve(Priority.SHEDDABLE) == LatencyObjective(5000.0, 500.0)


def test_request_beats_tenant_beats_class_field_by_field():
    tenant = ObjectiveOverride(ttft_ms=800.0, tpot_ms=80.0)
    assert POLICY.resolve(Priority.STANDARD, tenant) == LatencyObjective(800.0, 80.0)
    assert POLICY.resolve(Priority.STANDARD, tenant, ObjectiveOverride(ttft_ms=300.0)) == LatencyObjective(300.0, 80.0)
    assert POLICY.resolve(Priority.STANDARD, ObjectiveOverride(tpot_ms=60.0)) == LatencyObjective(1000.0, 60.0)


@pytest.mark.parametrize(("override", "message"), [
    (ObjectiveOverride(ttft_ms=10.0), "TTFT target 10 ms is below the minimum 50 ms"),
    (ObjectiveOverride(ttft_ms=70_000.0), "TTFT target 70000 ms is above the maximum 60000 ms"),
    (ObjectiveOverride(tpot_ms=1.5), "TPOT target 1.5 ms is below the minimum 5 ms"),
    (ObjectiveOverride(tpot_ms=2001.0), "TPOT target 2001 ms is above the maximum 2000 ms"),
])
def test_a_request_outside_the_bounds_is_invalid_naming_the_bound(override, message):
    with pytest.raises(InvalidArgument) as caught:
        POLICY.resolve(Priority.STANDARD, request=override)
    assert str(caught.value) == f"latency objective out of bounds: {message}"


def test_a_tenant_value_outside_the_bounds_is_held_to_the_nearer_bound():
    tenant = ObjectiveOverride(ttft_ms=1.0, tpot_ms=99_999.0)
    assert POLICY.resolve(Priority.STANDARD, tenant) == LatencyObjective(50.0, 2000.0)


def test_a_config_default_outside_the_bounds_or_a_missing_class_is_refused():
    with pytest.raises(ValueError, match="critical class: TTFT target 20 ms is below the minimum 50 ms"):
        ObjectivePolicy({**DEFAULTS, Priority.CRITICAL: LatencyObjective(20.0, 50.0)}, POLICY.bounds)
    with pytest.raises(ValueError, match="missing sheddable"):
        ObjectivePolicy({p: o for p, o in DEFAULTS.items() if p is not Priority.SHEDDABLE})
    with pytest.raises(ValueError, match="TTFT bounds must be 0 < min <= max"):
        ObjectiveBounds(min_ttft_ms=100, max_ttft_ms=50)


@pytest.mark.parametrize("value", ["abc", "-5", "0", "1e3", "inf", "nan", "1_000", "12.", " 5 ms"])
def test_a_malformed_header_is_invalid_naming_the_key(value):
    with pytest.raises(InvalidArgument, match="x-infermesh-ttft-ms must be a positive number of milliseconds"):
        parse_objective_ms(value, "x-infermesh-ttft-ms")


def test_headers_parse_as_milliseconds_and_empty_is_unset():
    assert parse_objective_ms(b" 250 ", "k") == 250.0
    assert parse_objective_ms("12.5", "k") == 12.5
    assert parse_objective_ms("", "k") is None
    assert parse_objective_ms(None, "k") is None


def test_field_and_header_both_sent_the_tighter_counts():
    assert request_override(300, 0, "200", None) == ObjectiveOverride(ttft_ms=200.0, tpot_ms=None)
    assert request_override(100, 40, "200", "90") == ObjectiveOverride(ttft_ms=100.0, tpot_ms=40.0)
    assert request_override(0, 0, None, None) == ObjectiveOverride()
