"""The sweep raises the rate until the SLO breaks, bisects, and reports the knee."""

import pytest

from loadtest.scenario import load_scenario, parse_scenario
from loadtest.sweep import judge, run_sweep, step_scenario, sweep_document
from loadtest.sweep_report import sweep_html, sweep_text


def _fake_report(rate_rps: float, capacity_rps: float) -> dict:
    """A mesh that keeps its SLO up to `capacity_rps` and loses goodput beyond it."""
    goodput = 1.0 if rate_rps <= capacity_rps else capacity_rps / rate_rps
    group = {"num_requests": int(rate_rps * 10), "goodput_ratio": goodput, "error_ratio": 0.0,
             "throughput_rps": min(rate_rps, capacity_rps), "latency_ms": {"p50": 5.0, "p99": 20.0 / goodput},
             "stream": None, "tail": {"top_stage": "queue_wait"}}
    return {"overall": group, "classes": {"c": group}, "generator": {"fell_behind": False, "lag_ms": {"p99": 0.2}}}


async def test_sweep_finds_the_knee_by_stepping_then_bisecting():
    scenario = load_scenario("loadtest/scenarios/demo.yaml")
    spec = scenario.sweep  # start 10, step 10, 2 refine steps
    rates = []

    async def run_step(step):
        rate = step.load.levels[0].from_value
        rates.append(rate)
        assert step.duration_s == spec.step_duration_s and step.warmup_s == spec.warmup_s
        return _fake_report(rate, capacity_rps=34.0)

    steps = await run_sweep(scenario, spec, run_step)
    assert rates == [10, 20, 30, 40, 35, 32.5]
    doc = sweep_document(scenario, spec, steps, target="t", started_at="2025-01-01T00:00:00+00:00")
    assert doc["knee_rps"] == 32.5 and doc["first_failing_rps"] == 35
    assert [s["rate_rps"] for s in doc["steps"]] == sorted(rates)
    assert "knee: 32.5 req/s" in sweep_text(doc)
    assert "data:image/png;base64," in sweep_html(doc)


async def test_sweep_stops_at_max_rate_when_the_slo_always_holds():
    scenario = load_scenario("loadtest/scenarios/demo.yaml")
    spec = scenario.sweep.__class__(**{**scenario.sweep.__dict__, "max_rps": 30.0})

    async def run_step(step):
        return _fake_report(step.load.levels[0].from_value, capacity_rps=1000.0)

    steps = await run_sweep(scenario, spec, run_step)
    doc = sweep_document(scenario, spec, steps, target="t", started_at="x")
    assert [s.rate_rps for s in steps] == [10, 20, 30]
    assert doc["knee_rps"] == 30 and doc["reached_max_rps"]


def test_a_generator_that_fell_behind_fails_the_step():
    report = _fake_report(10, 100)
    report["generator"]["fell_behind"] = True
    assert judge(report, load_scenario("loadtest/scenarios/demo.yaml").sweep) == (
        "load generator fell behind its schedule",)


def test_sweep_needs_an_open_loop():
    scenario = parse_scenario({"load": {"mode": "closed", "concurrency": 2}, "tenants": [{"api_key": "k"}],
                               "classes": [{"kind": "classify", "model": "m"}]})
    with pytest.raises(ValueError, match="open-loop"):
        step_scenario(scenario, 10.0, scenario.sweep)
