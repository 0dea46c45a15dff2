"""bench_token_path's derived figures: ratios of one run, headline medians against the targets."""

from __future__ import annotations

import math

from bench.token_path.bench_token_path import headline, over_baseline


def phase(name: str, p50_ms: float, tokens_per_s: float) -> dict:
    return {"phase": name, "e2e_p50_ms": p50_ms, "e2e_p99_ms": 2 * p50_ms, "tokens_per_s": tokens_per_s}


def run(scheduler_us: float, mesh_tokens_per_s: float) -> dict:
    sides = {"mesh": [phase("5/s", 550.0, 300.0), phase("30/s", 3000.0, mesh_tokens_per_s)],
             "baseline": [phase("5/s", 500.0, 300.0), phase("30/s", 5000.0, 1000.0)]}
    return {"scheduler": {"cpu_us_per_token": {"scheduler": scheduler_us}, "tokens_per_s": 1e4},
            "e2e": {**sides, "over_baseline": over_baseline(sides)}}


def test_ratios_pair_each_mesh_phase_with_the_same_runs_baseline():
    ratios = run(40.0, 1600.0)["e2e"]["over_baseline"]
    assert ratios == {"mesh": {"5/s": {"e2e_p50": 1.1, "e2e_p99": 1.1, "tokens_per_s": 1.0},
                               "30/s": {"e2e_p50": 0.6, "e2e_p99": 0.6, "tokens_per_s": 1.6}}}


def test_headline_takes_medians_and_says_whether_they_meet_the_targets():
    figures = headline([run(50.0, 1600.0), run(18.0, 1400.0), run(19.0, 1700.0)])
    assert figures["scheduler_us_per_token"] == {"target": "<= 20 us", "median": 19.0, "met": "yes",
                                                 "runs": [50.0, 18.0, 19.0]}
    assert figures["saturation_ratio"]["median"] == 1.6 and figures["saturation_ratio"]["met"] == "yes"
    assert figures["p50_ratio_5"]["met"] == "yes"  # 1.1 <= 1.1
    missing = figures["gateway_us_per_token"]  # no gateway part in these runs
    assert math.isnan(missing["median"]) and missing["met"] == "n/a"
