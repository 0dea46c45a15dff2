"""The pure parts of bench/worker/bench_structured_output.py: its report, table and mask digests (no timing)."""

from __future__ import annotations

import numpy as np

from bench.worker.structured_report import (
    engines_section,
    per_token_runs,
    stage_per_step,
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
    assert figures == {"run_medians_us": [2.0, 5.0, 2.5], "median_us": 2.5, "run_means_us": [11.0, 5.0, 2.5],
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
    section = engines_section(_llguidance_runs(), xgrammar, llguidance_digests=["1:a", "1:x", "3:c"])
    assert section["xgrammar"]["mask"]["median_us"] == 1.0
    assert section["xgrammar"]["refused_sequences"] == [0, 0]
    assert section["mask_xgrammar_over_llguidance"] == 1.0 / 10.0
    assert section["same_masks"] == {"positions": 3, "equal": 2,
                                     "first_difference": "position 1: xgrammar 2:b, llguidance 1:x"}


def test_table_lists_every_sampling_the_grammar_cpu_and_both_engines():
    report = {
        "saturated_tokens_per_s": {"greedy": throughput_section([100.0, 120.0], [96.0, 100.0]),
                                   "temperature_1": throughput_section([50.0], [60.0])},
        "grammar_cpu_per_token": {"mask": per_token_runs([[16.0], [18.0]]), "apply": per_token_runs([[20.0], [20.0]])},
        "worker_stage_ms_per_step": {"greedy plain": {"compute": 90.5, "postprocess": 1.7}},
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
    assert "| grammar mask + apply us/token, run means | 36, 38 |" in lines
    assert "| worker ms/step, greedy plain | compute 90.5, postprocess 1.7 |" in lines
    assert "| xgrammar mask us/token | skipped: no venv |" in lines
    assert "| load average (1 min) | 4.5, 5.25 |" in lines
