"""bench/harness/results.py: the one JSON report writer, and strict JSON for a report with NaNs."""

from __future__ import annotations

import json
import math

from bench.harness.results import finite, write_report


def test_write_report_makes_the_folder_and_writes_indented_json_ending_in_a_newline(tmp_path, capsys):
    path = tmp_path / "new" / "figures.json"
    assert write_report(path, {"runs": [1, 2]}, note="; load 1.0") == path
    text = path.read_text(encoding="utf-8")
    assert json.loads(text) == {"runs": [1, 2]}
    assert text.startswith('{\n  "runs"') and text.endswith("}\n")
    assert capsys.readouterr().out == f"wrote {path}; load 1.0\n"


def test_write_report_writes_what_json_cannot_through_default(tmp_path):
    path = write_report(tmp_path / "r.json", {"where": tmp_path}, default=str)
    assert json.loads(path.read_text(encoding="utf-8")) == {"where": str(tmp_path)}


def test_finite_turns_nan_and_infinity_into_null_at_any_depth():
    assert finite({"a": [1.0, math.nan, {"b": math.inf}], "c": "x"}) == {"a": [1.0, None, {"b": None}], "c": "x"}
