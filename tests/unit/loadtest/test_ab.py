"""A/B in one run: alternating slices, each side's own report, B/A side by side."""

from __future__ import annotations

import json

import pytest

from loadtest.ab import owned_time_s, slice_owner
from loadtest.cli import EXIT_OK, EXIT_USAGE, main
from tests.unit.loadtest.test_cli_targets import fake_openai_in_thread


def test_slices_alternate_and_split_time_evenly():
    assert [slice_owner(t, 0.5) for t in (0.0, 0.49, 0.5, 0.99, 1.0, 1.7)] == [0, 0, 1, 1, 0, 1]
    assert owned_time_s(0.0, 4.0, 0.5, 0) == pytest.approx(2.0) == owned_time_s(0.0, 4.0, 0.5, 1)
    assert owned_time_s(0.25, 1.25, 0.5, 0) == pytest.approx(0.5)  # 0.25-0.5 and 1.0-1.25
    assert owned_time_s(0.25, 1.25, 0.5, 1) == pytest.approx(0.5)


def test_ab_sets_a_slow_and_a_fast_server_side_by_side(tmp_path, capsys):
    scenario = tmp_path / "ab.yaml"
    scenario.write_text(json.dumps({
        "name": "ab", "duration_s": 1.0, "load": {"arrival": "constant", "rate_rps": 40},
        "tenants": [{"api_key": "k"}],
        "classes": [{"name": "gen", "kind": "generate", "model": "tinylm", "prompt_len": 8, "output_len": 4,
                     "deadline_ms": 5000}]}))
    with fake_openai_in_thread(token_s=0.001) as (fast, fast_url), fake_openai_in_thread(token_s=0.05) as (slow, slow_url):
        code = main(["ab", str(scenario), "--target", fast_url, "--target", slow_url, "--slice-s", "0.25",
                     "--out", str(tmp_path), "--no-progress"])
        assert code == EXIT_OK, capsys.readouterr()
        assert main(["ab", str(scenario), "--target", fast_url]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert "A/B: A = " in out and "B/A" in out
    doc = json.loads(next(tmp_path.glob("ab-ab-*.json")).read_text())
    assert doc["schema"] == "infermesh.loadtest.ab/v1" and doc["meta"]["slice_s"] == 0.25
    a, b = doc["a"], doc["b"]
    assert a["overall"]["num_ok"] == fast.num_calls and b["overall"]["num_ok"] == slow.num_calls
    assert fast.num_calls + slow.num_calls >= 79 and min(fast.num_calls, slow.num_calls) >= 38  # 40/s for 2 s
    assert a["overall"]["throughput_rps"] == pytest.approx(40, rel=0.05)  # per second of its own slices
    p50 = next(c for c in doc["comparison"] if c["group"] == "overall" and c["metric"] == "p50")
    # B sleeps 4 x 50 ms per request; A answers in a few ms when the box is idle, tens when it is loaded.
    assert p50["b"] >= 200 and p50["ratio"] > 1 and p50["effect"].startswith("+") and p50["a_ci"][1] < p50["b_ci"][0]
    assert next(tmp_path.glob("ab-ab-*.md")).read_text().startswith("# A/B: ab")
    assert "<table>" in next(tmp_path.glob("ab-ab-*.html")).read_text()
