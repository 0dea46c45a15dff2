"""The token fast path benchmark's Markdown tables, from a JSON document of its shape."""

from __future__ import annotations

from bench.token_path.tables import e2e_table, gateway_table, profile_table, scheduler_table, targets_table


def window(tokens_per_s: float, us: float) -> dict:
    return {"tokens_per_s": tokens_per_s, "num_completed": 10, "num_short": 0, "num_errors": 0,
            "cpu_cores": {"scheduler": 0.5, "client": 0.1, "workers": 0.2, "gateway": 0.4},
            "cpu_us_per_token": {"scheduler": us, "client": 5.0, "gateway": us + 1}}


def e2e(phase: str, p50_ms: float, tokens_per_s: float, errors: dict | None = None) -> dict:
    return {"phase": phase, "load_average": [3.0, 2.0, 1.0], "e2e_p50_ms": p50_ms, "e2e_p99_ms": 2 * p50_ms,
            "ttft_p50_ms": 20.0, "tokens_per_s": tokens_per_s, "num_ok": 9, "num_requests": 9 + len(errors or {}),
            "errors": errors or {}}


DOC = {
    "headline": {"scheduler_us_per_token": {"target": "<= 20 us", "median": 52.0, "runs": [52.0, 50.5, float("nan")],
                                            "met": "no"}},
    "runs": [{
        "run": 0,
        "scheduler": {"load_average": [3.5, 3.0, 2.0], **window(12804.0, 52.0)},
        "gateway": {"load_average": [4.3, 3.0, 2.0], "stream": window(4120.0, 94.0), "unary": window(3727.0, 134.0)},
        "e2e": {"mesh": [e2e("5/s", 600.0, 290.0, {"RESOURCE_EXHAUSTED": 1})], "baseline": [e2e("5/s", 500.0, 295.0)],
                "over_baseline": {"mesh": {"5/s": {"e2e_p50": 1.2, "e2e_p99": 1.2, "tokens_per_s": 0.983}}}},
    }],
}


def test_targets_table_shows_every_run_and_whether_the_median_meets_the_target():
    assert targets_table(DOC).splitlines()[2] == "| scheduler_us_per_token | <= 20 us | 52 | 52, 50, - | no |"


def test_part_tables_have_a_row_per_run_and_mode():
    assert scheduler_table(DOC).splitlines()[2].startswith("| 0 | 3.5 | 12804 | 52 |")
    rows = gateway_table(DOC).splitlines()[2:]
    assert [row.split(" | ")[1] for row in rows] == ["stream", "unary"]
    assert rows[0].split(" | ")[4] == "95"


def test_e2e_rows_pair_each_mesh_phase_with_the_baseline_and_its_ratios():
    row = e2e_table(DOC).splitlines()[2]
    assert row.startswith("| 0 | mesh | 5/s | 3.0 / 3.0 | 600 / 1200 | 500 / 1000 | 20 / 20 | 290 / 295 |")
    assert "1.2 / 1.2 / 0.983" in row and "9/10 RESOURCE_EXHAUSTED 1" in row
    assert row.endswith("| - / - |"), "runs recorded before the generator's lag was measured"
    lagged = {**DOC, "runs": [{**DOC["runs"][0], "e2e": {**DOC["runs"][0]["e2e"], "mesh": [
        {**DOC["runs"][0]["e2e"]["mesh"][0], "lag_p99_ms": 1.234}]}}]}
    assert e2e_table(lagged).splitlines()[2].endswith("| 1.2 / - |")


def test_profile_table_in_percent():
    profile = {"by_self": [{"name": "sendmsg (libc.so.6)", "self_share": 0.355, "total_share": 0.355}]}
    assert profile_table(profile, "by_self").splitlines()[2] == "| sendmsg (libc.so.6) | 35.5% | 35.5% |"
