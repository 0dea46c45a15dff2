from __future__ import annotations

import pytest

from services.gateway.calls.stage_timings import gateway_stages, ingress_s, parse_request_start_s


@pytest.mark.parametrize(
    ("value", "expected_s"),
    [
        ("t=1700000000123456", 1700000000.123456),  # microseconds
        ("t=1700000000123", 1700000000.123),  # milliseconds
        ("t=1700000000.5", 1700000000.5),  # seconds
        (b"1700000000123456", 1700000000.123456),
        ("t=abc", None),
        ("t=-5", None),
        (None, None),
    ],
)
def test_reads_x_request_start_in_any_common_unit(value, expected_s):
    parsed = parse_request_start_s(value)
    assert parsed == (None if expected_s is None else pytest.approx(expected_s))


def test_ingress_ignores_clocks_that_cannot_describe_a_wait():
    assert ingress_s(100.0, 100.25) == pytest.approx(0.25)
    assert ingress_s(101.0, 100.0) is None  # from the future: skewed clocks
    assert ingress_s(100.0, 100.0 + 7200) is None  # hours old: not a wait
    assert ingress_s(None, 100.0) is None


def test_gateway_stages_add_up_to_the_gateway_total_around_the_upstream_total():
    stages = gateway_stages(ingress_s=0.002, admission_s=0.001, upstream_s=0.010, upstream_total_us=7_000,
                            total_s=0.0125)
    by_name = {s.stage: s.duration_us for s in stages}
    assert by_name == {"ingress": 2000, "admission": 1000, "network": 3000, "overhead": 1500, "gateway": 12500}
    # admission + network + the scheduler's total + overhead = the gateway's total
    assert by_name["admission"] + by_name["network"] + 7_000 + by_name["overhead"] == by_name["gateway"]


def test_gateway_stages_without_ingress_or_upstream_call():
    stages = gateway_stages(ingress_s=None, admission_s=0.001, upstream_s=None, upstream_total_us=0, total_s=0.003)
    assert [(s.stage, s.duration_us) for s in stages] == [("admission", 1000), ("overhead", 2000), ("gateway", 3000)]
