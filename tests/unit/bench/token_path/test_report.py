"""Figures of the token fast path benchmark: per-token CPU, e2e figures, targets, profile summary."""

from __future__ import annotations

import math

import pytest

from bench.harness.send_result import SendResult
from bench.token_path.report import (
    Target,
    e2e_figures,
    median_of,
    ratio,
    speedscope_top,
    us_per_token,
)
from bench.token_path.workload import LoadPhase, closed_loop_requests, make_requests


def result(scheduled_s: float, done_s: float, status: str = "OK", num_tokens: int = 10) -> SendResult:
    return SendResult("t", scheduled_s, scheduled_s, done_s, status, ttft_s=0.05, num_tokens=num_tokens)


def test_us_per_token_is_nan_without_tokens():
    assert us_per_token(0.5, 25_000) == 20.0
    assert math.isnan(us_per_token(0.5, 0))


def test_e2e_figures_count_only_successful_streams_from_their_scheduled_send():
    results = [result(0.0, 0.1), result(1.0, 1.3), result(2.0, 2.2), result(3.0, 9.0, "UNAVAILABLE", 0)]
    figures = e2e_figures(results, elapsed_s=3.0)
    assert figures["num_ok"] == 3 and figures["errors"] == {"UNAVAILABLE": 1}
    assert figures["e2e_p50_ms"] == 200.0 and figures["e2e_p99_ms"] == 300.0
    assert figures["ttft_p50_ms"] == 50.0
    assert figures["tokens_per_s"] == 10.0  # 30 tokens over 3 s
    assert figures["lag_p99_ms"] == 0.0 and figures["lag_max_ms"] == 0.0  # every request sent on schedule
    late = SendResult("t", 1.0, 1.004, 1.3, "OK", ttft_s=0.05, num_tokens=10)
    assert e2e_figures([*results, late], elapsed_s=3.0)["lag_max_ms"] == 4.0


def test_ratio_and_median_skip_missing_figures():
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))
    runs = [{"a": 3.0}, {"a": 1.0}, {"b": 7.0}, {"a": math.nan}, {"a": 2.0}]
    assert median_of(runs, lambda r: r["a"]) == 2.0
    assert math.isnan(median_of([{}], lambda r: r["a"]))


def test_targets_say_whether_the_figure_meets_them():
    at_most = Target("scheduler CPU per token", "<=", 20, " us")
    assert (at_most.met(19.5), at_most.met(20.5), at_most.met(math.nan)) == ("yes", "no", "n/a")
    assert at_most.text == "<= 20 us"
    assert Target("tokens/s", ">=", 20_000).met(25_000) == "yes"
    with pytest.raises(ValueError, match="op must be '<=' or '>=', got '<'"):
        Target("x", "<", 1)


def test_speedscope_top_sums_self_and_total_shares_over_threads():
    doc = {
        "shared": {"frames": [{"name": "main", "file": "/x/services/scheduler/server.py"},
                              {"name": "step", "file": "/x/services/scheduler/step_scheduler.py"},
                              {"name": "encode", "file": "/venv/lib/python3.11/site-packages/grpc/aio.py"}]},
        "profiles": [
            {"type": "sampled", "samples": [[0, 1], [0, 1, 2], [0, 1, 2]], "weights": [0.01, 0.01, 0.01]},
            {"type": "sampled", "samples": [[0], []], "weights": [0.01, 0.01]},
        ],
    }
    num_samples, by_self, by_total = speedscope_top(doc, top_n=2)
    assert num_samples == 4  # the empty stack is no sample
    assert [(f.name, f.self_share) for f in by_self] == [
        ("encode (site-packages/grpc/aio.py)", 0.5), ("step (services/scheduler/step_scheduler.py)", 0.25)]
    assert [(f.name, f.total_share) for f in by_total] == [
        ("main (services/scheduler/server.py)", 1.0), ("step (services/scheduler/step_scheduler.py)", 0.75)]


def test_the_same_seed_gives_the_same_requests_within_the_issue_bounds():
    requests = make_requests(20.0, 30.0, seed=3)
    assert requests == make_requests(20.0, 30.0, seed=3)
    assert 450 < len(requests) < 750
    assert all(8 <= len(r.prompt.encode()) <= 48 and 8 <= r.max_tokens <= 128 for r in requests)
    assert list(r.scheduled_s for r in requests) == sorted(r.scheduled_s for r in requests)
    assert len(closed_loop_requests(16, seed=3)) == 16


def test_a_phase_is_either_open_or_closed_loop():
    assert LoadPhase("5/s", 10.0, 1, rate_per_s=5.0).open_loop
    assert len(LoadPhase("closed 4", 10.0, 1, concurrency=4).requests()) == 256
    with pytest.raises(ValueError, match="set exactly one of rate_per_s"):
        LoadPhase("both", 10.0, 1, rate_per_s=5.0, concurrency=4)


def test_open_loops_rate_over_their_span_and_closed_loops_over_their_window():
    from bench.token_path.report import rate_window_s

    assert rate_window_s(True, duration_s=20.0, elapsed_s=31.5) == 31.5
    assert rate_window_s(False, duration_s=20.0, elapsed_s=23.0) == 20.0


def test_owners_charge_each_sample_to_its_innermost_services_frame():
    from bench.token_path.report import NO_OWNER, speedscope_owners

    doc = {
        "shared": {"frames": [{"name": "run", "file": "/x/services/gateway/server.py"},
                              {"name": "Generate", "file": "/x/services/gateway/servicer.py"},
                              {"name": "sendmsg", "file": "libc.so.6"},
                              {"name": "poll", "file": "/venv/lib/python3.11/threading.py"}]},
        "profiles": [{"type": "sampled", "samples": [[0, 1, 2], [0, 1], [0, 2], [3]], "weights": [1, 1, 1, 1]}],
    }
    assert speedscope_owners(doc) == [("Generate (services/gateway/servicer.py)", 0.5),
                                      ("run (services/gateway/server.py)", 0.25), (NO_OWNER, 0.25)]
