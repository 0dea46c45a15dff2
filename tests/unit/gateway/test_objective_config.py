"""The gateway's latency-objective settings become one ObjectivePolicy; bad ones fail at start."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.common.objectives import LatencyObjective
from services.common.priority import Priority
from services.gateway.config import GatewayConfig


def test_per_class_targets_and_bounds_come_from_the_settings():
    policy = GatewayConfig(allow_anonymous=True, slo_ttft_ms=(200.0, 1000.0, 5000.0),
                           slo_tpot_ms=(50.0, 100.0, 400.0), slo_ttft_bounds_ms=(100.0, 9000.0)).objective_policy()
    assert policy.by_priority[Priority.CRITICAL] == LatencyObjective(200.0, 50.0)
    assert policy.by_priority[Priority.SHEDDABLE] == LatencyObjective(5000.0, 400.0)
    assert (policy.bounds.min_ttft_ms, policy.bounds.max_ttft_ms) == (100.0, 9000.0)


@pytest.mark.parametrize(("over", "message"), [
    ({"slo_ttft_ms": (1.0, 2.0)}, "slo_ttft_ms needs 3 values"),
    ({"slo_tpot_bounds_ms": (5.0,)}, "slo_tpot_bounds_ms needs 2 values"),
    ({"slo_ttft_ms": (5.0, 1000.0, 2000.0)}, "critical class: TTFT target 5 ms is below the minimum 10 ms"),
    ({"slo_tpot_bounds_ms": (10.0, 1.0)}, "TPOT bounds must be 0 < min <= max"),
])
def test_bad_objective_settings_fail_at_start_saying_why(over, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig(allow_anonymous=True, **over)
