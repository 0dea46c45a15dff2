"""The pure parts of bench_gpu_llm: greedy agreement with the CPU, latency summaries, its tables (no timing)."""

from __future__ import annotations

import math

import pytest

from bench.worker.gpu_llm_report import (
    Divergence,
    agreement,
    first_divergence,
    graphs_table,
    latency_summary,
    mesh_table,
    peak_decode,
    steps_table,
    tpot_s,
)


@pytest.mark.parametrize(("reference", "candidate", "expected"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([1, 2, 3], [7, 2, 3], 0),
    ([1, 2, 3], [1, 2], 2),
    ([], [], None),
])
def test_first_divergence_is_the_first_differing_index_or_where_the_shorter_ends(reference, candidate, expected):
    assert first_divergence(reference, candidate) == expected


def test_agreement_counts_identical_streams_and_tokens_before_each_divergence():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    candidate = [[1, 2, 3, 4], [5, 6, 0, 0], [0, 9, 9, 9]]
    divergences = [Divergence(1, 2, 0.5, 0.5), Divergence(2, 0, 1e-5, 1e-5)]

    result = agreement(reference, candidate, divergences, near_tie=1e-3)

    assert result["num_streams"] == 3
    assert result["identical_streams"] == 1
    assert result["tokens_before_first_divergence_fraction"] == pytest.approx((4 + 2 + 0) / 12)
    assert len(result["divergences"]) == 2
    assert result["not_near_ties"] == [{"prompt_index": 1, "at": 2, "cpu_margin": 0.5, "cpu_gap_to_device_pick": 0.5}]


def test_latency_summary_is_nearest_rank_in_milliseconds():
    summary = latency_summary([0.001, 0.002, 0.003, 0.010])

    assert summary["p50_ms"] == pytest.approx(2.0)
    assert summary["p99_ms"] == pytest.approx(10.0)
    assert summary["mean_ms"] == pytest.approx(4.0)
    assert summary["n"] == 4


def test_latency_summary_of_nothing_is_nan():
    assert math.isnan(latency_summary([])["p50_ms"])
    assert math.isnan(latency_summary([])["mean_ms"])


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert tpot_s(0.1, 0.4, 4) == pytest.approx(0.1)
    assert math.isnan(tpot_s(0.1, 0.1, 1))


def _row(device, dtype, kind, batch, tokens, step_ms, model="m", context=256):
    return {"model": model, "device": device, "dtype": dtype, "kind": kind, "batch": batch, "tokens": tokens,
            "context": context, "step_ms": step_ms, "tokens_per_s": tokens / (step_ms / 1e3)}


def test_steps_table_has_a_line_per_model_device_and_dtype_and_a_column_per_batch():
    rows = [_row("cuda", "float16", "decode", 1, 1, 2.0), _row("cuda", "float16", "decode", 64, 64, 4.0),
            _row("cuda", "float16", "prefill", 1, 512, 8.0), _row("cpu", "float32", "decode", 1, 1, 20.0)]

    lines = steps_table(rows).splitlines()

    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["step ms (decode at 256)", "b=1", "b=64", "prefill 512"]
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == ["m cuda float16", "2.00", "4.00", "8.00"]
    assert [c.strip() for c in lines[3].split("|")[1:-1]] == ["m cpu float32", "20.00", "-", "-"]


def test_peak_decode_is_the_best_decode_rate_of_each_line():
    rows = [_row("cuda", "float16", "decode", 1, 1, 2.0), _row("cuda", "float16", "decode", 64, 64, 4.0),
            _row("cuda", "float16", "prefill", 1, 512, 8.0)]

    assert peak_decode(rows) == {"m cuda float16": pytest.approx(16_000.0)}


def test_mesh_table_gives_both_sides_and_their_ratio():
    side = {"ttft": {"p50_ms": 10.0, "p99_ms": 20.0}, "tpot": {"p50_ms": 1.0, "p99_ms": 2.0}}
    mesh = {"compute_dtype": "float16",
            "saturated": {"streams": 64, "tokens_per_stream": 64, "mesh_tokens_per_s": 900.0,
                          "one_process_tokens_per_s": 1000.0, "ratio_mesh_over_one_process": 0.9},
            "light": {"mesh": side, "one_process": side,
                      "ratios_mesh_over_one_process": {"ttft_p50": 1.0, "ttft_p99": 1.0, "tpot_p50": 1.0,
                                                       "tpot_p99": 1.0}}}

    lines = mesh_table(mesh).splitlines()

    assert "mesh (float16)" in lines[0]
    assert [c.strip() for c in lines[2].split("|")[1:-1]] == ["tokens/s, 64 streams x 64", "900.0", "1000.0", "0.90"]
    assert len(lines) == 2 + 5


def test_graphed_decode_rows_get_a_line_of_their_own():
    rows = [_row("cuda", "float16", "decode", 1, 1, 2.0), {**_row("cuda", "float16", "decode", 1, 1, 0.5), "path": "graph"}]

    lines = steps_table(rows).splitlines()

    assert [c.strip() for c in lines[2].split("|")[1:-1]] == ["m cuda float16", "2.00"]
    assert [c.strip() for c in lines[3].split("|")[1:-1]] == ["m cuda float16 graphed", "0.50"]
    assert peak_decode(rows) == {"m cuda float16": pytest.approx(500.0),
                                 "m cuda float16 graphed": pytest.approx(2000.0)}


def test_graphs_table_gives_off_on_and_their_ratio_then_identical_streams():
    def side(tokens_per_s, tpot_ms):
        return {"tokens_per_s": tokens_per_s, "ttft": {"p50_ms": 10.0, "p99_ms": 20.0},
                "tpot": {"p50_ms": tpot_ms, "p99_ms": tpot_ms}, "worker_start_s": 9.0}

    graphs = {"off": side(1000.0, 10.0), "on": side(4000.0, 2.5), "streams": 64, "tokens_per_stream": 64,
              "burst_streams_identical": {"identical": 128, "streams": 128},
              "light_streams_identical": {"identical": 9, "streams": 10},
              "worker_log": {"off": [], "on": ["INFO CUDA graphs captured for decode batches of 1, 2, 4 sequences"]}}

    lines = graphs_table(graphs).splitlines()

    assert [c.strip() for c in lines[2].split("|")[1:-1]] == ["tokens/s, 64 streams x 64", "1000.0", "4000.0", "4.00"]
    assert [c.strip() for c in lines[5].split("|")[1:-1]] == ["TPOT p50 ms, one at a time", "10.0", "2.5", "0.25"]
    assert lines[-2] == "  greedy streams identical off vs on: burst 128/128, one at a time 9/10"
    assert lines[-1].endswith("CUDA graphs captured for decode batches of 1, 2, 4 sequences")
