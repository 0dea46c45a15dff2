"""The pure parts of bench/worker/bench_structured_output.py: its report, table and mask digests (no timing)."""

from __future__ import annotations

import numpy as np

from bench.worker.structured_report import (
    by_mask_width,
    engines_section,
    per_token_runs,
    stage_per_step,
    stage_ratio,
    table,
    throughput_section,
)
from bench.worker.xgrammar_masks import mask_digest


def test_throughput_section_is_the_ratio_of_medians_against_the_target():
    section = throughput_section([100.0, 90.0, 110.0], [80.0, 70.0, 95.0])
    assert section["plain"] == {"runs": [100.0, 90.0, 110.0], "median": 100.0}
    assert section["json_schema"]["median"] == 80.0
    assert section["ratio_of_medians"] == 0.8
    assert section["met"] is True
    assert throughput_section([100.0], [79.0])["met"] is False
    assert throughput_section([], [79.0])["ratio_of_medians"] is None


def test_per_token_runs_reports_every_runs_median_and_their_median():
    figures = per_token_runs([[1.0, 2.0, 30.0], [4.0, 5.0, 6.0], [2.0, 3.0]])
    assert figures == {"run_medians_us": [2.0, 5.0, 2.5], "median_us": 2.5, "run_means_us": [11.0, 5.0, 2.5], "mean_us": 5.0,
                       "tokens_per_run": [3, 3, 2]}
    assert per_token_runs([])["median_us"] is None


def test_stage_per_step_divides_each_stages_new_seconds_by_its_new_steps():
    before = {"compute": (1.0, 10.0), "postprocess": (0.5, 10.0)}
    after = {"compute": (3.0, 30.0), "postprocess": (0.5, 10.0), "queue": (0.2, 2.0)}
    assert stage_per_step(before, after) == {"compute": 100.0, "queue": 100.0}  # postprocess: no new step


def test_mask_digest_names_the_allowed_ids_whatever_the_padding_past_the_vocabulary():
    allowed = np.zeros(40, dtype=bool)
    allowed[[0, 9, 33]] = True
    packed = np.packbits(np.concatenate([allowed, np.ones(24, dtype=bool)]), bitorder="little")  # 2 words
    digest = mask_digest(packed, 40)
    assert digest.startswith("3:")
    assert digest == mask_digest(np.packbits(allowed, bitorder="little"), 40)
    allowed[9] = False
    assert mask_digest(np.packbits(allowed, bitorder="little"), 40) != digest


def _llguidance_runs():
    return [{"mask_us": [10.0, 12.0, 11.0], "advance_us": [0.5, 0.4, 0.6]},
            {"mask_us": [9.0, 9.0, 30.0], "advance_us": [0.5, 0.5, 0.5]}]


def test_engines_section_without_xgrammar_says_why():
    section = engines_section(_llguidance_runs(), None, "no .venv-xgrammar")
    assert section["llguidance"]["mask"]["run_medians_us"] == [11.0, 9.0]
    assert section["xgrammar"] == {"skipped": "no .venv-xgrammar"}
    assert "same_masks" not in section


def test_engines_section_compares_the_masks_medians_and_digests():
    xgrammar = {"version": "0.2.8", "tokenizer_s": 0.03, "compile_s": 0.06, "mask_digests": ["1:a", "2:b", "3:c"],
                "runs": [{"mask_us": [1.0, 1.0, 2.0], "advance_us": [2.0, 3.0, 2.0], "refused_sequences": 0},
                         {"mask_us": [1.0, 1.0, 1.0], "advance_us": [2.0, 2.0, 2.0], "refused_sequences": 0}]}
    section = engines_section(_llguidance_runs(), xgrammar, llguidance_digests=["1:a", "1:x", "3000:c"])
    assert section["xgrammar"]["mask"]["median_us"] == 1.0
    assert section["xgrammar"]["refused_sequences"] == [0, 0]
    assert section["mask_xgrammar_over_llguidance_median"] == 1.0 / 10.0
    assert section["xgrammar"]["mask"]["mean_us"] == 1.17  # the median of its runs' means, 1.33 and 1
    assert section["llguidance"]["mask"]["mean_us"] == 13.5  # of 11 and 16
    assert section["mask_xgrammar_over_llguidance_mean"] == 1.17 / 13.5
    assert section["same_masks"] == {"positions": 3, "equal": 1,
                                     "first_difference": "position 1: xgrammar 2:b, llguidance 1:x"}
    assert section["xgrammar"]["mask_by_width_first_run"]["wide"] == {"positions": 1, "median_us": 2.0, "mean_us": 2.0}
    assert section["llguidance"]["mask_by_width_first_run"]["narrow"] == {"positions": 2, "median_us": 11.0,
                                                                          "mean_us": 11.0}


def test_table_lists_every_sampling_the_grammar_cpu_and_both_engines():
    report = {
        "saturated_tokens_per_s": {"greedy": throughput_section([100.0, 120.0], [96.0, 100.0]),
                                   "temperature_1": throughput_section([50.0], [60.0])},
        "grammar_cpu_per_token": {"mask": per_token_runs([[16.0], [18.0]]), "apply": per_token_runs([[20.0], [20.0]])},
        "worker_stage_ms_per_step": {"greedy plain": {"compute": 90.5, "postprocess": 1.7}},
        "ratio_from_worker_stages": {"greedy": stage_ratio({"compute": 90.0, "postprocess": 2.0},
                                                           {"compute": 110.0, "postprocess": 7.0})},
        "engines": engines_section(_llguidance_runs(), None, "no venv"),
        "load_average_1m": [4.5, 5.25],
    }
    text = table(report)
    lines = text.splitlines()
    assert lines[0] == "| figure | value |"
    assert "| greedy: plain tok/s (median; runs) | 110; 100, 120 |" in lines
    assert "| greedy: ratio (target >= 0.8) | 0.891 |" in lines
    assert "| temperature_1: ratio (target >= 0.8) | 1.2 |" in lines
    assert "| grammar mask us/token (median; run medians) | 17; 16, 18 |" in lines
    assert ("| greedy: ratio the worker's stages imply (compute ms/step; postprocess plain, schema) | 0.953 (100; 2, 7) |"
            in lines)
    assert "| greedy: the grammar on the step's critical path, ms/step (postprocess schema - plain) | 5 |" in lines
    assert "| grammar mask + apply us/token, run means | 36, 38 |" in lines
    assert "| worker ms/step, greedy plain | compute 90.5, postprocess 1.7 |" in lines
    assert "| xgrammar mask us/token | skipped: no venv |" in lines
    assert "| llguidance mask us/token (median; run medians | run means) | 10; 11, 9 | 11, 16 |" in lines
    assert "| load average (1 min) | 4.5, 5.25 |" in lines


def test_by_mask_width_splits_a_runs_times_at_a_thousand_allowed_ids():
    split = by_mask_width([1.0, 200.0, 3.0, 100.0], ["5:a", "12000:b", "1000:c", "1001:d"])
    assert split == {"narrow": {"positions": 2, "median_us": 2.0, "mean_us": 2.0},
                     "wide": {"positions": 2, "median_us": 150.0, "mean_us": 150.0}}
    assert by_mask_width([], [])["wide"] == {"positions": 0, "median_us": None, "mean_us": None}


def test_stage_ratio_takes_one_forward_figure_for_both_phases():
    implied = stage_ratio({"compute": 90.0, "postprocess": 2.0}, {"compute": 110.0, "postprocess": 12.0})
    assert implied == {"compute_ms": 100.0, "postprocess_plain_ms": 2.0, "postprocess_schema_ms": 12.0,
                       "grammar_critical_path_ms": 10.0, "ratio": round(102 / 112, 3)}
    assert stage_ratio({}, {"compute": 1.0, "postprocess": 1.0}) == {"ratio": None}
