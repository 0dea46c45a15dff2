"""The knee search (bench/loadtest/knee.py) on fake steps: no server, no clock."""

from __future__ import annotations

import pytest

from bench.loadtest.bench_tensor_knee import scenario as knee_scenario
from bench.loadtest.knee import (
    Criteria,
    Knee,
    Plan,
    StepFigures,
    Verdict,
    find_knee,
    judge,
    knee_document,
    knee_ratio,
    step_figures,
)
from loadtest.report_json import build_report
from loadtest.runner import RunResult
from loadtest.scenario import RequestKind
from tests.unit.loadtest.conftest import make_record

CRITERIA = Criteria(p99_ms=100.0, max_lag_p99_ms=10.0)


def figures(rate: float = 100.0, p99: float | None = 50.0, errors: dict[str, int] | None = None, lag: float = 1.0,
            num_requests: int = 200, service_p50: float | None = None, service_p99: float | None = None) -> StepFigures:
    errors = errors or {}
    p50 = None if p99 is None else p99 / 2
    return StepFigures(rate, num_requests, sum(errors.values()), errors, rate, p50, p99, p99,
                       p50 if service_p50 is None else service_p50, p99 if service_p99 is None else service_p99,
                       lag, lag * 2)


def server(knee_rps: float, lag_from_rps: float = float("inf"), noisy: set[float] | None = None):
    """A fake step: p99 50 ms up to `knee_rps`, 150 ms above; the generator lags 30 ms from
    `lag_from_rps` up, and once (the first try) at each rate in `noisy`. Records the rates run."""
    rates: list[float] = []
    noisy = set(noisy or ())

    async def run_step(rate: float) -> StepFigures:
        rates.append(rate)
        lag = 30.0 if rate >= lag_from_rps or rate in noisy else 1.0
        noisy.discard(rate)
        return figures(rate, p99=50.0 if rate <= knee_rps else 150.0, lag=lag, service_p50=20.0)

    return run_step, rates


def test_a_step_passes_strictly_under_the_p99_bound_with_no_errors():
    assert judge(figures(p99=99.9), CRITERIA) == (Verdict.PASS, ())
    assert judge(figures(p99=100.0), CRITERIA) == (Verdict.FAIL, ("p99 100.0 ms >= 100 ms",))
    assert judge(figures(errors={"RESOURCE_EXHAUSTED": 2, "DEADLINE_EXCEEDED": 1}), CRITERIA) == (
        Verdict.FAIL, ("3 errors (DEADLINE_EXCEEDED 1, RESOURCE_EXHAUSTED 2)",))
    assert judge(figures(num_requests=0, p99=None), CRITERIA) == (Verdict.FAIL, ("no requests measured",))


def test_a_step_where_the_generator_fell_behind_is_untrusted_unless_the_median_service_time_broke_the_bound():
    verdict, reasons = judge(figures(p99=180.0, lag=25.0, service_p50=20.0, service_p99=160.0), CRITERIA)
    assert verdict is Verdict.BEHIND  # a stall of the whole machine: the tail, not the median
    assert reasons == ("generator lag p99 25.0 ms > 10 ms", "p99 180.0 ms >= 100 ms")
    verdict, reasons = judge(figures(p99=900.0, lag=250.0, service_p50=600.0, service_p99=850.0), CRITERIA)
    assert verdict is Verdict.FAIL and reasons[0].startswith("service-time p50 600.0 ms >= 100 ms")
    verdict, reasons = judge(figures(lag=11.0, errors={"RESOURCE_EXHAUSTED": 127}), CRITERIA)
    assert verdict is Verdict.FAIL and reasons[0] == "the server refused 127 requests, whatever the generator's lateness"
    assert judge(figures(lag=11.0, errors={"DEADLINE_EXCEEDED": 3, "CANCELLED": 2}), CRITERIA)[0] is Verdict.BEHIND
    assert judge(figures(lag=10.0), CRITERIA)[0] is Verdict.PASS  # at the bound is still on schedule


async def test_the_search_doubles_until_a_failure_then_bisects():
    run_step, rates = server(knee_rps=300)
    knee = await find_knee(Plan(50, 3200, refine_steps=2), CRITERIA, run_step)
    assert rates == [50, 100, 200, 400, 300, 350]
    assert (knee.knee_rps, knee.first_failing_rps, knee.bounded_by) == (300, 350, "server")
    assert not knee.is_lower_bound
    assert [s.verdict for s in knee.steps] == [Verdict.PASS] * 3 + [Verdict.FAIL, Verdict.PASS, Verdict.FAIL]


async def test_a_generator_that_falls_behind_twice_bounds_the_knee_from_below():
    run_step, rates = server(knee_rps=1000, lag_from_rps=250)
    knee = await find_knee(Plan(50, 3200, refine_steps=1), CRITERIA, run_step)
    assert rates == [50, 100, 200, 400, 400, 300, 300]  # each late rate run twice
    assert (knee.knee_rps, knee.first_failing_rps, knee.bounded_by) == (200, 300, "generator")
    assert knee.is_lower_bound


async def test_a_moments_lag_is_retried_and_the_retry_decides():
    run_step, rates = server(knee_rps=300, noisy={100})
    knee = await find_knee(Plan(50, 3200, refine_steps=0), CRITERIA, run_step)
    assert rates == [50, 100, 100, 200, 400]
    assert [s.verdict for s in knee.steps][1:3] == [Verdict.BEHIND, Verdict.PASS]
    assert (knee.knee_rps, knee.bounded_by) == (200, "server")


async def test_a_failing_start_steps_down_before_bisecting():
    run_step, rates = server(knee_rps=120)
    knee = await find_knee(Plan(400, 3200, refine_steps=1), CRITERIA, run_step)
    assert rates == [400, 200, 100, 150]
    assert (knee.knee_rps, knee.first_failing_rps) == (100, 150)


async def test_the_search_stops_at_max_rps_and_says_so():
    run_step, rates = server(knee_rps=10_000)
    knee = await find_knee(Plan(50, 300, refine_steps=2), CRITERIA, run_step)
    assert rates == [50, 100, 200, 300]
    assert (knee.knee_rps, knee.first_failing_rps, knee.bounded_by) == (300, None, "max_rps")


async def test_no_passing_rate_gives_no_knee():
    run_step, rates = server(knee_rps=1)
    knee = await find_knee(Plan(80, 320, refine_steps=2), CRITERIA, run_step)
    assert rates == [80, 40, 20]  # down to start / 4
    assert (knee.knee_rps, knee.first_failing_rps, knee.bounded_by) == (None, 20, "no pass")
    assert knee_document(knee)["steps"][0]["verdict"] == "fail"


async def test_a_bad_plan_is_refused():
    run_step, _ = server(knee_rps=100)
    with pytest.raises(ValueError, match="start_rps <= max_rps"):
        await find_knee(Plan(500, 100), CRITERIA, run_step)


def _knee(rps: float | None, bounded_by: str) -> Knee:
    return Knee(rps, None, bounded_by, ())


@pytest.mark.parametrize("ours,peer,expected", [
    (_knee(600, "server"), _knee(150, "server"), (4.0, "exact")),
    (_knee(600, "generator"), _knee(150, "server"), (4.0, ">=")),
    (_knee(600, "server"), _knee(150, "max_rps"), (4.0, "<=")),
    (_knee(600, "generator"), _knee(150, "generator"), (4.0, "unknown")),
    (_knee(600, "server"), _knee(None, "no pass"), (None, "unknown")),
])
def test_the_ratio_says_how_to_read_it(ours, peer, expected):
    assert knee_ratio(ours, peer) == expected


def test_step_figures_read_a_harness_report():
    s = knee_scenario(200, step_s=2, warmup_s=0.5, max_lag_ms=10)
    records = [make_record(i, latency_s=0.010 + i * 1e-4, scheduled_s=0.5 + i * 0.005, class_name="cnn",
                           kind=RequestKind.TENSOR) for i in range(100)]
    records.append(make_record(100, scheduled_s=1.2, class_name="cnn", kind=RequestKind.TENSOR,
                               status="RESOURCE_EXHAUSTED"))
    report = build_report(s, RunResult(tuple(records), (500, 2_000, 40_000), 2.0), target="kserve+grpc://x:1",
                          started_at="2026-11-29T00:00:00+00:00")
    f = step_figures(200, report)
    assert (f.rate_rps, f.num_requests, f.num_errors, f.errors) == (200, 101, 1, {"RESOURCE_EXHAUSTED": 1})
    assert f.p50_ms == pytest.approx(15, abs=0.2) and f.p99_ms == pytest.approx(19.9, abs=0.2)
    assert f.service_p99_ms is not None and f.lag_max_ms == pytest.approx(40, abs=0.1)


def test_the_bench_sends_the_cnns_input_as_a_tensor_class():
    s = knee_scenario(400, step_s=2, warmup_s=0.5, max_lag_ms=10)
    (c,) = s.classes
    assert c.kind is RequestKind.TENSOR and c.model == "bench-cnn" and c.slo.e2e_ms == 100
    assert c.tensor is not None
    (x,) = c.tensor.inputs
    assert (x.name, x.datatype, [d.low for d in x.shape]) == ("x", "FP32", [1, 3, 32, 32])
    assert s.load.levels[0].from_value == 400 and s.duration_s == 2 and s.lag_warn_ms == 10


async def test_a_saved_knee_reads_back_as_it_was():
    import json

    from bench.loadtest.knee import knee_from_document

    run_step, _ = server(knee_rps=300, lag_from_rps=350)
    knee = await find_knee(Plan(50, 3200, refine_steps=2), CRITERIA, run_step)
    assert knee_from_document(json.loads(json.dumps(knee_document(knee)))) == knee


async def test_two_searches_take_turns_one_step_at_a_time():
    import asyncio

    from bench.loadtest.bench_tensor_knee import search_all

    order: list[str] = []
    running = 0

    def runner(address: str):
        run_step, _ = server(knee_rps=300 if address == "a" else 100)

        async def step(rate: float) -> StepFigures:
            nonlocal running
            running += 1
            assert running == 1  # never two steps at once
            order.append(address)
            await asyncio.sleep(0)
            running -= 1
            return await run_step(rate)

        return step

    knees = await search_all({"mesh": "a", "ray serve": "b"}, Plan(50, 3200, refine_steps=1), CRITERIA, runner)
    assert (knees["mesh"].knee_rps, knees["ray serve"].knee_rps) == (300, 100)
    assert order[:6] == ["a", "b"] * 3  # in turn while both searches last
