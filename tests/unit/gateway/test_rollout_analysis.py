"""The canary analysis on synthetic samples: each check catches a real regression, tolerates noise,
and accounts for sample size; the policy parser names the field that is wrong."""

from __future__ import annotations

import random

import pytest

from services.gateway.rollout import stats
from services.gateway.rollout.analysis import Verdict, judge
from services.gateway.rollout.policy import (
    Checks,
    Override,
    RolloutPolicy,
    RolloutPolicyError,
    Step,
    parse_rollout_policy,
)
from services.gateway.rollout.window import Window

STEP = Step(10.0)
SHADOW = Step(0.0, shadow=True)


def _fail(field: str, problem: str) -> RolloutPolicyError:
    return RolloutPolicyError(f"field '{field}': {problem}")


def make_policy(**over) -> RolloutPolicy:
    base = dict(canary_version="2", steps=(SHADOW, Step(10.0), Step(100.0)), min_requests=50, min_duration_s=1.0)
    return RolloutPolicy(**{**base, **over})


def window(n: int, *, error_rate: float = 0.0, miss_rate: float = 0.0, latency_s: float = 0.010,
           spread: float = 0.2, seed: int = 1, stages: dict[str, float] | None = None) -> Window:
    rng, w = random.Random(seed), Window()
    for _ in range(n):
        draw = rng.random()
        code = "INTERNAL" if draw < error_rate else "DEADLINE_EXCEEDED" if draw < error_rate + miss_rate else "OK"
        jitter = 1 + rng.uniform(-spread, spread)
        w.record(code, latency_s * jitter, [(k, v * jitter) for k, v in (stages or {}).items()])
    return w


# --------------------------------------------------------------------------- statistics


def test_proportion_test_needs_more_evidence_from_fewer_samples():
    assert stats.proportion_worse(20, 0, 20, 1) > 0.05, "one error in 20 is noise"
    assert stats.proportion_worse(2000, 20, 2000, 100) < 1e-6, "1% -> 5% over 2000 each is not"
    assert stats.proportion_worse(2000, 20, 2000, 30, max_increase=0.01) == 1.0, "within the tolerance"
    assert stats.proportion_worse(0, 0, 10, 10) == 1.0, "no baseline: no evidence"


def test_shift_test_detects_a_slower_canary_beyond_the_tolerated_ratio():
    rng = random.Random(3)
    base = [0.010 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(200)]
    same = [0.010 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(30)]
    slow = [0.030 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(30)]
    assert stats.shift_worse(base, same, 1.2) > 0.5
    assert stats.shift_worse(base, slow, 1.2) < 1e-6
    assert stats.shift_worse(base, [0.011] * 30, 1.2) > 0.5, "10% slower is within max_ratio 1.2"


def test_latency_tests_need_the_margin_as_well_as_the_ratio():
    rng = random.Random(4)
    base = [0.0002 * (1 + rng.uniform(-0.1, 0.1)) for _ in range(300)]
    doubled = [2 * b for b in base[:200]]
    assert stats.shift_worse(base, doubled, 1.2) < 1e-6, "without a margin a 0.2 ms stage at 0.4 ms is worse"
    assert stats.shift_worse(base, doubled, 1.2, min_increase_s=0.001) > 0.5, "but 0.2 ms more is within 1 ms"
    assert stats.tail_worse(base, doubled, 1.2, min_increase_s=0.001) == 1.0
    assert stats.shift_worse(base, [b + 0.005 for b in base[:50]], 1.2, min_increase_s=0.001) < 1e-6
    assert stats.worse_bound(0.010, 1.2, 0.001) == pytest.approx(0.012)
    assert stats.worse_bound(0.001, 1.2, 0.001) == pytest.approx(0.002)


def test_tail_test_counts_exceedances_of_the_baselines_p99():
    base = [0.010] * 990 + [0.050] * 10
    assert stats.tail_worse(base, [0.010] * 200, 1.0) == 1.0
    assert stats.tail_worse(base, [0.010] * 190 + [0.2] * 10, 1.0) < 1e-4, "5% above the p99 is a worse tail"
    assert stats.tail_worse(base[:50], [0.2] * 50, 1.0) == 1.0, "too few baseline samples to know its p99"


def test_wilson_bound_and_agreement():
    low, high = stats.wilson_bounds(0, 10, 0.95)
    assert low == 0.0 and 0.25 < high < 0.35
    assert not stats.agreement_below(19, 20, 0.98, 0.95), "one disagreement in 20 proves nothing"
    assert stats.agreement_below(2, 20, 0.98, 0.95)
    assert not stats.agreement_below(0, 0, 0.98, 0.95)


def test_normal_quantile_inverts_the_tail():
    assert stats.normal_quantile(0.975) == pytest.approx(1.95996, abs=1e-4)
    with pytest.raises(ValueError, match="p must be in"):
        stats.normal_quantile(1.0)


def test_binomial_tail_matches_a_direct_sum():
    assert stats.binomial_sf(2, 3, 0.5) == pytest.approx(0.5)
    assert stats.binomial_sf(0, 5, 0.1) == 1.0 and stats.binomial_sf(6, 5, 0.1) == 0.0


# --------------------------------------------------------------------------- judging a step


def test_an_equal_canary_advances_once_it_has_its_requests_and_time():
    policy = make_policy()
    baseline, canary = window(500, error_rate=0.01, seed=1), window(60, error_rate=0.01, seed=2)
    assert judge(policy, STEP, baseline, canary, elapsed_s=0.5).verdict is Verdict.WAIT, "before min_duration"
    assert judge(policy, STEP, baseline, window(20, seed=2), elapsed_s=5).verdict is Verdict.WAIT
    judgement = judge(policy, STEP, baseline, canary, elapsed_s=5)
    assert judgement.verdict is Verdict.ADVANCE, judgement.evidence()


def test_a_canary_failing_5_percent_is_rolled_back():
    judgement = judge(make_policy(), STEP, window(1000, seed=1), window(300, error_rate=0.05, seed=2), elapsed_s=5)
    assert judgement.verdict is Verdict.ROLL_BACK
    assert [c.name for c in judgement.failures] == ["error_rate"]
    assert "error_rate" in judgement.evidence().split(";")[1]


def test_a_canary_three_times_slower_in_compute_is_rolled_back_at_once():
    stages = {"worker.compute": 0.005}
    slow = window(15, latency_s=0.030, stages={"worker.compute": 0.015}, seed=2)
    judgement = judge(make_policy(min_requests=500), STEP, window(400, stages=stages), slow, elapsed_s=0.1)
    assert judgement.verdict is Verdict.ROLL_BACK, "no waiting for min_requests when the evidence is in"
    assert {"latency:end_to_end", "latency:worker.compute"} <= {c.name for c in judgement.failures}


def test_deadline_misses_are_their_own_check():
    judgement = judge(make_policy(), STEP, window(1000), window(300, miss_rate=0.1, seed=2), elapsed_s=5)
    assert [c.name for c in judgement.failures] == ["deadline_misses"]


def test_shadow_step_counts_comparisons_and_rolls_back_on_disagreement():
    policy = make_policy(min_requests=20)
    canary = window(30, seed=2)
    for i in range(30):
        canary.compared(agreed=i % 10 == 0)
    judgement = judge(policy, SHADOW, window(300), canary, elapsed_s=5)
    assert judgement.verdict is Verdict.ROLL_BACK
    assert [c.name for c in judgement.failures] == ["agreement"]
    agreeing = window(30, seed=2)
    for _ in range(25):
        agreeing.compared(agreed=True)
    assert judge(policy, SHADOW, window(300), agreeing, elapsed_s=5).verdict is Verdict.ADVANCE


def test_shadow_step_judges_latency_on_the_versions_own_work_only():
    """Mirrored calls are sheddable-class and capped in flight: waiting longer is their priority."""
    policy = make_policy(min_requests=20)
    stages = {"worker.compute": 0.004, "scheduler.queue_wait": 0.002}
    waited = {"worker.compute": 0.004, "scheduler.queue_wait": 0.030}
    canary = window(200, latency_s=0.040, stages=waited, seed=2)
    for _ in range(200):
        canary.compared(agreed=True)
    judgement = judge(policy, SHADOW, window(1000, stages=stages), canary, elapsed_s=5)
    assert judgement.verdict is Verdict.ADVANCE, judgement.evidence()
    assert {c.name for c in judgement.checks if c.name.startswith(("latency", "p99"))} == {
        "latency:worker.compute", "p99:worker.compute"}
    slow = window(200, latency_s=0.040, stages={**waited, "worker.compute": 0.012}, seed=2)
    for _ in range(200):
        slow.compared(agreed=True)
    judgement = judge(policy, SHADOW, window(1000, stages=stages), slow, elapsed_s=5)
    assert judgement.verdict is Verdict.ROLL_BACK
    assert "latency:worker.compute" in {c.name for c in judgement.failures}


def test_checks_switched_off_are_not_run():
    policy = make_policy(checks=Checks(error_rate_max_increase=None, latency_max_ratio=None))
    judgement = judge(policy, STEP, window(1000), window(300, error_rate=0.5, latency_s=1.0), elapsed_s=5)
    assert judgement.verdict is Verdict.ADVANCE
    assert [c.name for c in judgement.checks] == ["deadline_misses"]


def test_significance_is_split_over_the_tests_run():
    judgement = judge(make_policy(confidence=0.95), STEP, window(300, stages={"a.b": 0.001}),
                      window(300, seed=3, stages={"a.b": 0.001}), elapsed_s=5)
    assert judgement.alpha == pytest.approx(0.05 / 6)  # errors, misses, and median + p99 for two latencies


# --------------------------------------------------------------------------- the policy


def parse(spec: dict, default: str = "1", versions: tuple[str, ...] = ("1", "2")) -> RolloutPolicy:
    return parse_rollout_policy(spec, default, versions, _fail)


def test_policy_parses_with_defaults():
    policy = parse({"canary_version": 2, "steps": ["shadow", 1, 10, 100]})
    assert policy.canary_version == "2"
    assert [s.name for s in policy.steps] == ["shadow", "1%", "10%", "100%"]
    assert policy.checks == Checks() and policy.override is Override.AUTOMATIC
    off = parse({"canary_version": "2", "steps": [100], "checks": {"latency": False, "agreement": {"min_agreement": 0.9}},
                 "override": "pause"})
    assert off.checks.latency_max_ratio is None and off.checks.min_agreement == 0.9
    margin = parse({"canary_version": "2", "steps": [100], "checks": {"latency": {"min_increase_ms": 5}}})
    assert (margin.checks.latency_max_ratio, margin.checks.latency_min_increase_ms) == (1.2, 5.0)
    assert off.override is Override.PAUSE


def test_policy_identity_ignores_the_override_only():
    spec = {"canary_version": "2", "steps": [10, 100]}
    assert parse(spec).rollout_id == parse({**spec, "override": "pause"}).rollout_id
    assert parse(spec).rollout_id != parse({**spec, "attempt": 2}).rollout_id


@pytest.mark.parametrize(("spec", "message"), [
    ("x", "field 'rollout': must be a mapping"),
    ({"steps": [1]}, "field 'rollout.canary_version': is required"),
    ({"canary_version": "1", "steps": [1]}, "'1' is the default version"),
    ({"canary_version": "3", "steps": [1]}, "'3' is not listed under versions"),
    ({"canary_version": "2"}, "field 'rollout.steps': is required"),
    ({"canary_version": "2", "steps": [10, 5]}, "field 'rollout.steps[1]': must be above the step before (10)"),
    ({"canary_version": "2", "steps": [10, "shadow"]}, "shadow can only be the first step"),
    ({"canary_version": "2", "steps": [0]}, "must be 'shadow' or a percent in (0, 100], got 0"),
    ({"canary_version": "2", "steps": [1], "min_requests": 0}, "field 'rollout.min_requests': must be an integer >= 1"),
    ({"canary_version": "2", "steps": [1], "confidence": 1.5}, "field 'rollout.confidence': must be a number in (0.5"),
    ({"canary_version": "2", "steps": [1], "override": "stop"}, "must be pause, abort or promote"),
    ({"canary_version": "2", "steps": [1], "speed": 1}, "field 'rollout.speed': unknown field"),
    ({"canary_version": "2", "steps": [1], "checks": {"p50": {}}}, "field 'rollout.checks.p50': unknown check"),
    ({"canary_version": "2", "steps": [1], "checks": {"latency": {"max_ratio": 0.5}}},
     "field 'rollout.checks.latency.max_ratio': must be a number >= 1"),
    ({"canary_version": "2", "steps": [1], "checks": {"error_rate": {"max": 1}}},
     "field 'rollout.checks.error_rate.max': unknown field"),
])
def test_bad_policies_name_the_field(spec, message):
    with pytest.raises(RolloutPolicyError) as raised:
        parse(spec)
    assert message in str(raised.value)
