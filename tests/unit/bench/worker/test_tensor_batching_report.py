"""bench_tensor_batching's report: medians of runs, the ratio, the SLO verdict and the tables (no timing)."""

from __future__ import annotations

from bench.worker.tensor_batching_report import (
    Direct,
    LoadRun,
    direct_table,
    load_table,
    model_summary,
    verdict_lines,
)


def run(requests_per_s: float, p99_ms: float, load_1m: float = 2.0) -> LoadRun:
    return LoadRun(requests_per_s, p99_ms / 2, p99_ms, int(requests_per_s * 3), 0, load_1m, 0.9, 12.5, 1.0, 2.0)


def test_speedup_is_the_ratio_of_medians_and_each_run_pair_is_kept() -> None:
    summary = model_summary({"batching on": [run(900, 60), run(600, 80), run(1000, 50)],
                             "batching off": [run(200, 700), run(250, 650), run(150, 800)]})
    assert summary["batching on"]["median_requests_per_s"] == 900
    assert summary["batching off"]["median_requests_per_s"] == 200
    assert summary["speedup"] == 4.5
    assert summary["speedup_by_run"] == [4.5, 2.4, 1000 / 150]
    assert summary["batching on"]["median_p99_ms"] == 60
    assert (summary["on_p99_within_slo"], summary["every_on_run_p99_within_slo"], summary["met"]) == (True, True, True)


def test_on_arm_p99_over_the_slo_fails_the_target_whatever_the_ratio() -> None:
    summary = model_summary({"batching on": [run(900, 120), run(900, 90), run(900, 150)],
                             "batching off": [run(100, 700)] * 3})
    assert summary["speedup"] == 9
    assert (summary["on_p99_within_slo"], summary["met"]) == (False, False)


def test_a_ratio_under_three_is_not_met() -> None:
    summary = model_summary({"batching on": [run(500, 40)] * 3, "batching off": [run(300, 50)] * 3})
    assert summary["met"] is False
    assert "not met" in verdict_lines({"m": summary})[0]


def test_tables_show_every_run_and_the_overhead() -> None:
    summary = model_summary({"batching on": [run(900, 60, 1.5), run(600, 80, 2.5), run(1000, 50, 3.5)],
                             "batching off": [run(200, 700)] * 3})
    table = load_table({"bench-vgg": summary})
    assert "| bench-vgg | batching on | 900 | 900 / 600 / 1000 |" in table
    assert "1.5 / 2.5 / 3.5" in table
    assert "12.5 / 12.5 / 12.5" in table
    direct = Direct({1: 5.0, 8: 1.5, 32: 0.5}, mesh_ms=7.5, batching_mesh_ms=9.0)
    assert direct.overhead_ms == 2.5
    assert "| bench-vgg | 5 | 1.5 | 0.5 | 7.5 | 2.5 | 33% | 9 |" in direct_table({"bench-vgg": direct})
