"""A load-test report of a run that spans a rollout shows the decision points on the windows' timeline."""

from __future__ import annotations

import datetime as dt
import random

import pytest

from loadtest.report_text import markdown_report
from loadtest.rollout_report import rollout_section, rollout_table, short_evidence
from loadtest.tables import report_tables
from services.gateway.rollout.controller import RolloutController
from services.gateway.rollout.store import FileRolloutStore
from services.gateway.routing.table import parse_routing_config
from tests.unit.loadtest.test_reports import _demo_report
from tools.testbed.fake_clock import FakeClock

START = dt.datetime(2026, 11, 27, 10, 0, 0, tzinfo=dt.UTC)
ROUTES = parse_routing_config({"models": {"digits": {
    "default_version": "1", "endpoints": ["127.0.0.1:1"], "versions": {"2": {}},
    "rollout": {"canary_version": "2", "steps": [10, 100], "min_requests": 20, "min_duration_s": 5}}}}, "r")


class NoShares:
    def set_shares(self, model, shares) -> None:
        return None


def doc() -> dict:
    return {"meta": {"started_at": START.isoformat(timespec="seconds"), "warmup_s": 2.0, "duration_s": 30.0},
            "windows": {"window_s": 1.0, "overall": []}}


def test_an_automatic_rollback_is_placed_on_the_runs_timeline(tmp_path):
    clock = FakeClock(START.timestamp() + 5.0)  # the rollout starts 3 s into the measured run
    path = tmp_path / "rollouts.json"
    controller = RolloutController(NoShares(), FileRolloutStore(path), clock=clock)
    controller.apply_routes(ROUTES)
    rng = random.Random(1)
    for _ in range(300):
        controller.record("digits", "1", "OK", 0.01 * (1 + rng.uniform(-0.2, 0.2)))
    for i in range(30):
        controller.record("digits", "2", "INTERNAL" if i % 3 == 0 else "OK", 0.01)
    clock.advance(4.0)
    controller.tick()

    section = rollout_section(doc(), path)
    assert [(d["t_s"], d["action"]) for d in section["decisions"]] == [(3.0, "start"), (7.0, "roll_back")]
    assert "error_rate" in section["decisions"][1]["evidence"]
    table = rollout_table({**doc(), "rollout": section})
    text = table.to_text()
    assert "roll_back" in text and "7.0" in text
    assert "error_rate" in text and "FAIL" in text and "latency:end_to_end" not in text, "failed checks only"
    assert "latency:end_to_end" in section["decisions"][1]["evidence"], "the JSON keeps every check"
    report = _demo_report()
    report["rollout"] = section
    assert "Rollout decisions" in [t.title.split(" (")[0] for t in report_tables(report, with_windows=True)]
    assert "roll_back" in markdown_report(report)


def test_decisions_outside_the_run_are_left_out_and_a_bad_file_is_named(tmp_path):
    path = tmp_path / "rollouts.json"
    path.write_text('{"models": {"digits": {"decisions": [{"at_s": 1.0, "action": "start"}]}}}')
    section = rollout_section(doc(), path)
    assert section["decisions"] == []
    assert "no decision" in rollout_table({**doc(), "rollout": section}).note
    path.write_text("[1]")
    with pytest.raises(ValueError, match="has no 'models' mapping"):
        rollout_section(doc(), path)
    with pytest.raises(ValueError, match="cannot read"):
        rollout_section(doc(), tmp_path / "absent.json")


def test_the_table_shortens_a_judgement_to_its_counts_and_failures():
    judged = "canary n=30 baseline n=300 after 4.0 s; error_rate 10.00% vs 0.00% p=1e-05 FAIL; deadline_misses 0% vs 0% p=1"
    assert short_evidence(judged) == "canary n=30 baseline n=300 after 4.0 s; error_rate 10.00% vs 0.00% p=1e-05 FAIL"
    passed = "canary n=30 baseline n=300 after 4.0 s; error_rate 0% vs 0% p=1; golden 3/3 right vs 3 cases"
    assert short_evidence(passed) == "canary n=30 baseline n=300 after 4.0 s; all 2 checks passed"
    assert short_evidence("by hand") == "by hand"


def test_the_committed_report_of_a_real_rollback_shows_its_decision_points():
    """bench/baselines/rollout-rollback-*.json: a run of loadtest/scenarios/rollout-rollback.yaml
    (docs/operations.md, "Rollouts"): errors in the windows between start and roll_back, none after."""
    import json
    from pathlib import Path

    from loadtest.scenario import load_scenario

    assert load_scenario("loadtest/scenarios/rollout-rollback.yaml").classes[0].model == "mock-classifier"
    (path,) = Path("bench/baselines").glob("rollout-rollback-*.json")
    report = json.loads(path.read_text())
    start, roll_back = report["rollout"]["decisions"]
    assert (start["action"], roll_back["action"]) == ("start", "roll_back") and start["t_s"] < roll_back["t_s"]
    rows = rollout_table(report).rows
    assert rows[1][3] == "roll_back" and rows[1][5].endswith("FAIL") and "latency" not in rows[1][5]
    errors_after = sum(w["num_errors"] for w in report["windows"]["overall"] if w["start_s"] > roll_back["t_s"] + 1)
    assert errors_after == 0
