"""The overload benchmark's table: medians over runs, rows per part, JSON-safe values."""

from __future__ import annotations

import math

from bench.overload.report import markdown_table, medians, noise_line, table_rows


def section(p99_ms: float = 10.0, lag_p99_ms: float = 1.0, behind: bool = False, coverage: float = 0.5) -> dict:
    return {"p99_ms": p99_ms, "p50_ms": p99_ms / 2, "lag_p99_ms": lag_p99_ms, "generator_fell_behind": behind,
            "coverage_p50": coverage, "coverage_p99": coverage / 2, "ttft_p99_ms": p99_ms, "e2e_p99_ms": 10 * p99_ms}


def run(peak: float, fraction_2x: float, flood_ratio: float) -> dict:
    multiples = {key: {**section(), "fraction_of_peak": f} for key, f in (("1x", 1.0), ("2x", fraction_2x),
                                                                          ("4x", fraction_2x / 2))}
    return {
        "peak": {"peak_per_s": peak, "best": section(), "load_average_1m": 2.0},
        "multiples": {**multiples, "load_average_1m": 3.0},
        "flood": {"p99_ratio": flood_ratio, "alone": section(10.0), "flooded": section(10.0 * flood_ratio, 9.0, True),
                  "load_average_1m": 4.0},
    }


def test_medians_take_the_middle_run_of_each_figure_and_skip_parts_not_run():
    runs = [run(100.0, 0.5, 3.0), run(300.0, 0.9, 1.0), run(200.0, 0.7, 2.0)]
    m = medians(runs)
    assert m["peak_per_s"] == 200.0
    assert m["2x"] == 0.7
    assert m["4x"] == 0.35
    assert m["flood_ratio"] == 2.0
    assert math.isnan(m["lone_p50_ms"])  # no run had the lone part


def test_table_shows_every_run_the_median_and_flags_a_generator_that_fell_behind():
    rows = table_rows([run(100.0, 0.5, 3.0), run(300.0, 0.9, 1.0), run(200.0, 0.7, 2.0)])
    by_figure = {r[0]: r for r in rows}
    assert by_figure["peak goodput (ok <= 100 ms)/s"][1:4] == ("100, 300, 200", "200", ">= 1.3x today's")
    assert by_figure["goodput at 2x peak / peak"][1:4] == ("0.50, 0.90, 0.70", "0.70", ">= 0.90")
    flood = by_figure["flood: A p99 with B at 10x quota / alone"]
    assert flood[2] == "2.00"
    assert flood[4] == "50%/25%, 50%/25%, 50%/25%"
    assert flood[5] == "9.0 BEHIND, 9.0 BEHIND, 9.0 BEHIND"
    assert not any(r[0].startswith(("generate", "lone request")) for r in rows)  # parts not run
    table = markdown_table(rows).splitlines()
    assert table[0].startswith("| figure") and set(table[1]) <= {"|", "-"}
    assert len({len(line) for line in table}) == 1  # columns padded to one width


def test_noise_line_spans_the_load_averages_of_every_part():
    assert noise_line([run(1, 1, 1), run(1, 1, 1)]).startswith("load average (1 min) at each part's start: 2.00-4.00")
