"""The overload benchmark's plan: Poisson schedules, merging streams, dealing over load processes."""

from __future__ import annotations

import numpy as np
import pytest

from bench.harness.load_plan import (
    LoadPlan,
    RequestTemplate,
    Rpc,
    Send,
    Stream,
    build_plan,
    num_load_procs,
    poisson_times_s,
    request_start_header,
    split_plan,
)


def template(tenant: str, body: bytes = b"x") -> RequestTemplate:
    return RequestTemplate(Rpc.CLASSIFY, body, f"key-{tenant}", tenant, 0.1)


def test_poisson_times_are_increasing_inside_the_window_with_the_expected_count_and_gaps():
    times = poisson_times_s(1000.0, 20.0, np.random.default_rng(1))
    assert np.all(np.diff(times) > 0)
    assert times[0] >= 0 and times[-1] < 20.0
    # 20000 expected, standard deviation ~141: 5 sigma either way.
    assert abs(len(times) - 20_000) < 710
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1e-3, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1


def test_poisson_times_tops_up_when_the_first_draw_falls_short():
    # Tiny expected counts are where the initial over-draw is proportionally smallest.
    counts = [len(poisson_times_s(2.0, 1.0, np.random.default_rng(seed))) for seed in range(2000)]
    assert np.mean(counts) == pytest.approx(2.0, abs=0.15)
    assert max(counts) > 6  # the tail past the initial draw is reachable


def test_poisson_times_of_zero_rate_or_duration_are_empty_and_negative_ones_rejected():
    assert len(poisson_times_s(0.0, 5.0, np.random.default_rng(1))) == 0
    assert len(poisson_times_s(5.0, 0.0, np.random.default_rng(1))) == 0
    with pytest.raises(ValueError, match="rate_per_s and duration_s must be >= 0, got -1.0 and 1.0"):
        poisson_times_s(-1.0, 1.0, np.random.default_rng(1))


def test_build_plan_merges_streams_in_time_order_and_cycles_each_streams_templates():
    a = (template("a", b"a0"), template("a", b"a1"))
    b = (template("b"),)
    plan = build_plan([Stream(a, 200.0, 2.0), Stream(b, 50.0, 1.0, start_s=0.5)], seed=3)
    times = [s.scheduled_s for s in plan.sends]
    assert times == sorted(times)
    assert plan.duration_s == 2.0
    tenants = [plan.templates[s.template].tenant for s in plan.sends]
    b_times = [s.scheduled_s for s, t in zip(plan.sends, tenants, strict=True) if t == "b"]
    assert min(b_times) >= 0.5 and max(b_times) < 1.5
    a_bodies = [plan.templates[s.template].body for s, t in zip(plan.sends, tenants, strict=True) if t == "a"]
    assert a_bodies[:4] == [b"a0", b"a1", b"a0", b"a1"]


def test_build_plan_is_reproducible_and_streams_draw_independently():
    a, b = (template("a"),), (template("b"),)
    one = build_plan([Stream(a, 100.0, 1.0), Stream(b, 100.0, 1.0)], seed=5)
    assert one == build_plan([Stream(a, 100.0, 1.0), Stream(b, 100.0, 1.0)], seed=5)
    a_only = build_plan([Stream(a, 100.0, 1.0)], seed=5)
    # Adding a second stream does not move the first one's arrivals.
    assert [s.scheduled_s for s in one.sends if s.template == 0] == [s.scheduled_s for s in a_only.sends]


def test_build_plan_rejects_a_stream_without_templates():
    with pytest.raises(ValueError, match="stream 1 has no request templates"):
        build_plan([Stream((template("a"),), 1.0, 1.0), Stream((), 1.0, 1.0)], seed=1)


def test_split_plan_deals_round_robin_and_the_parts_add_up_to_the_plan():
    sends = tuple(Send(i / 10, 0) for i in range(10))
    plan = LoadPlan((template("a"),), sends, 1.0)
    parts = split_plan(plan, 3)
    assert [len(p.sends) for p in parts] == [4, 3, 3]
    assert parts[1].sends == (sends[1], sends[4], sends[7])
    assert sorted((s for p in parts for s in p.sends), key=lambda s: s.scheduled_s) == list(sends)
    assert all(p.duration_s == 1.0 and p.templates == plan.templates for p in parts)
    with pytest.raises(ValueError, match="num_parts must be >= 1, got 0"):
        split_plan(plan, 0)


def test_num_load_procs_grows_with_the_rate_between_one_and_the_cap():
    assert num_load_procs(20.0, 700.0, 3) == 1
    assert num_load_procs(700.0, 700.0, 3) == 1
    assert num_load_procs(701.0, 700.0, 3) == 2
    assert num_load_procs(100_000.0, 700.0, 3) == 3
    with pytest.raises(ValueError, match="per_proc_per_s must be > 0 and max_procs >= 1, got 0.0, 3"):
        num_load_procs(1.0, 0.0, 3)


def test_request_start_header_is_unix_microseconds_of_the_scheduled_time():
    assert request_start_header(1_700_000_000.25, 1.5) == ("x-request-start", "t=1700000001750000")
