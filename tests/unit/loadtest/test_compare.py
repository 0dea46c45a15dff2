"""`compare` gates on regressions beyond thresholds and exits non-zero."""

import copy

import pytest

from loadtest.cli import EXIT_OK, EXIT_REGRESSION, EXIT_USAGE, main
from loadtest.compare import METRICS, compare_reports, is_regression, parse_threshold
from loadtest.report_json import build_report, write_json
from loadtest.runner import RunResult
from loadtest.scenario import load_scenario
from tests.unit.loadtest.conftest import make_record


def _report(latency_scale: float = 1.0, num_errors: int = 0) -> dict:
    scenario = load_scenario("loadtest/scenarios/smoke.yaml")
    records = [make_record(i, latency_s=(0.005 + 0.0001 * i) * latency_scale, scheduled_s=1.0 + i * 0.0045,
                           status="UNAVAILABLE" if i < num_errors else "OK") for i in range(1000)]
    return build_report(scenario, RunResult(tuple(records), (), 5.0), target="t", started_at="2025-01-01T00:00:00+00:00")


@pytest.fixture
def reports(tmp_path):
    def write(name: str, doc: dict):
        path = tmp_path / f"{name}.json"
        write_json(doc, path)
        return str(path)
    return write


def test_compare_exits_non_zero_on_an_injected_p99_regression(reports, capsys):
    base, slower = reports("base", _report()), reports("new", _report(latency_scale=1.25))
    assert main(["compare", base, slower, "--max-regression", "p99=10%"]) == EXIT_REGRESSION
    out = capsys.readouterr().out
    assert "REGRESSED" in out and "overall p99" in out
    assert main(["compare", base, slower, "--max-regression", "p99=30%"]) == EXIT_OK
    assert main(["compare", base, reports("same", _report()), "--max-regression", "p99=1%,p50=1%"]) == EXIT_OK


def test_compare_gates_error_ratio_in_percentage_points(reports):
    base, errors = reports("base", _report()), reports("new", _report(num_errors=20))
    assert main(["compare", base, errors, "--max-regression", "error_ratio=1%"]) == EXIT_REGRESSION
    assert main(["compare", base, errors, "--max-regression", "error_ratio=3%"]) == EXIT_OK


def test_compare_improvements_never_count_as_regressions():
    base, faster = _report(), _report(latency_scale=0.5)
    cells, _ = compare_reports(base, faster, [parse_threshold("p99=1%"), parse_threshold("throughput=1%")])
    assert not any(c.regressed for c in cells)
    assert {c.group for c in cells} >= {"overall", "class:classify-small", "tenant:alpha"}


def test_compare_restricted_to_groups_and_warns_about_missing_ones():
    base = _report()
    new = copy.deepcopy(base)
    del new["tenants"]["beta"]
    cells, warnings = compare_reports(base, new, [parse_threshold("p99=5ms")], ["overall", "tenant:beta"])
    assert {c.group for c in cells} == {"overall"}
    assert warnings == ["group 'tenant:beta' is missing from the new report"]


@pytest.mark.parametrize("text,metric,limit,relative", [
    ("p99=10%", "p99", 0.10, True),
    ("p99.9=25ms", "p99.9", 25.0, False),
    ("throughput = 5%", "throughput", 0.05, True),
    ("error_ratio=1%", "error_ratio", 0.01, False),
    ("ttft_p99=20%", "ttft_p99", 0.2, True),
])
def test_parse_threshold(text, metric, limit, relative):
    t = parse_threshold(text)
    assert (t.metric, t.relative) == (metric, relative) and t.limit == pytest.approx(limit)


@pytest.mark.parametrize("text,message", [("p98=10%", "unknown metric"), ("p99", "expected METRIC="),
                                          ("throughput=5ms", "not ms")])
def test_parse_threshold_rejects_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        parse_threshold(text)


def test_regression_direction_depends_on_the_metric():
    t = parse_threshold("throughput=10%")
    assert is_regression(METRICS["throughput"], t, base=100, new=85)
    assert not is_regression(METRICS["throughput"], t, base=100, new=120)
    assert is_regression(METRICS["p99"], parse_threshold("p99=10%"), base=100, new=111)


def test_compare_refuses_a_file_that_is_not_a_v1_report(reports, tmp_path, capsys):
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"schema": "something/v0"}')
    assert main(["compare", reports("base", _report()), str(bogus)]) == EXIT_USAGE
    assert "expected 'infermesh.loadtest/v1'" in capsys.readouterr().err


def _sampled_report(seed: int) -> dict:
    """1000 requests whose latencies are draws from one lognormal: two seeds are two runs of the same server."""
    import numpy as np

    scenario = load_scenario("loadtest/scenarios/smoke.yaml")
    latencies_s = np.random.default_rng(seed).lognormal(np.log(0.01), 0.5, 1000)
    records = [make_record(i, latency_s=float(s), scheduled_s=1.0 + i * 0.0045) for i, s in enumerate(latencies_s)]
    return build_report(scenario, RunResult(tuple(records), (), 5.0), target="t", started_at="2025-01-01T00:00:00+00:00")


def test_compare_says_no_change_when_the_intervals_overlap_even_past_a_threshold():
    base, rerun = _sampled_report(1), _sampled_report(2)
    cells, _ = compare_reports(base, rerun, [parse_threshold("p99=1%"), parse_threshold("p50=0.5%")], ["overall"])
    for metric in ("p99", "p50"):
        cell = next(c for c in cells if c.metric == metric)
        assert cell.change > {"p99": 0.01, "p50": 0.005}[metric], cell  # worse past the threshold...
        assert cell.base_ci and cell.new_ci and cell.no_change and cell.effect == "no change"
        assert not cell.regressed  # ...but within noise


def test_compare_reports_the_effect_when_the_intervals_do_not_overlap(reports, capsys):
    base, slower = _report(), _report(latency_scale=1.25)
    cells, _ = compare_reports(base, slower, [parse_threshold("p99=10%")], ["overall"])
    p99 = next(c for c in cells if c.metric == "p99")
    assert not p99.no_change and p99.regressed
    assert p99.effect.endswith("(+25.0%)") and p99.effect.startswith("+")
    assert next(c for c in cells if c.metric == "throughput").effect == ""  # rates have no interval
    main(["compare", reports("b", base), reports("n", slower)])
    assert p99.effect in capsys.readouterr().out
