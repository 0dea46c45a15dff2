"""The canary analysis: one step's baseline and canary windows in, a verdict with its evidence out.

    judge(policy, step, baseline, canary, elapsed_s, golden) -> Judgement

Every enabled check runs as a one-sided test that the canary is worse (rollout/stats.py); the
step's significance level 1 - confidence is split evenly over the tests run (Bonferroni), so
adding stages to compare does not make a false rollback likelier. Then:

  any test significant, or a golden case answered wrongly  -> ROLL_BACK (at once: no minimum to wait for)
  canary has min_requests and the step min_duration, and
  (with golden cases) a run of them passed in this step     -> ADVANCE
  otherwise                                                 -> WAIT

Golden checks are exact, not statistical: a known input has one right answer, so one wrong
answer is proof (rollout/golden.py).

At the shadow step the canary's "requests" are the mirrored calls, and agreement is judged on
their comparisons with the baseline's answers. Latency is compared for the end to end time and
every stage both versions report with enough samples (MIN_LATENCY_SAMPLES each); at the shadow
step only the worker's stages (the version's own work): a mirrored call is sheddable-class and
capped in flight, so its queueing and end to end time measure its priority, not the version.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.gateway.rollout import stats
from services.gateway.rollout.golden import GoldenOutcome
from services.gateway.rollout.policy import RolloutPolicy, Step
from services.gateway.rollout.window import END_TO_END, Window

MIN_LATENCY_SAMPLES = 10
# The stages that measure a version's own work, whatever the request's class (metrics.stage_samples names).
OWN_WORK_PREFIX = "worker."


class Verdict(enum.Enum):
    WAIT = "wait"
    ADVANCE = "advance"
    ROLL_BACK = "roll_back"


@dataclass(frozen=True)
class CheckResult:
    # error_rate | deadline_misses | latency:<name> | p99:<name> | agreement | golden
    name: str
    baseline: str  # the baseline's value, readable ("0.40%", "12.1 ms")
    canary: str
    # None where the check is not a test against the baseline (agreement uses a bound instead).
    p_value: float | None
    failed: bool

    def describe(self) -> str:
        p = "" if self.p_value is None else f" p={self.p_value:.2g}"
        return f"{self.name} {self.canary} vs {self.baseline}{p}{' FAIL' if self.failed else ''}"


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    checks: tuple[CheckResult, ...]
    num_baseline: int
    num_canary: int
    elapsed_s: float
    # Per-test significance level used.
    alpha: float

    @property
    def failures(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.failed)

    def evidence(self) -> str:
        """One line: the counts and every check, failures first."""
        checks = sorted(self.checks, key=lambda c: not c.failed)
        return (f"canary n={self.num_canary} baseline n={self.num_baseline} after {self.elapsed_s:.1f} s; "
                + "; ".join(c.describe() for c in checks))


def judge(policy: RolloutPolicy, step: Step, baseline: Window, canary: Window, elapsed_s: float,
          golden: GoldenOutcome | None = None) -> Judgement:
    """golden: the step's latest complete run of the policy's golden cases (None: none yet)."""
    checks = policy.checks
    tests: list[tuple[str, str, str, float]] = []  # (name, baseline text, canary text, p-value)
    if checks.error_rate_max_increase is not None:
        tests.append(_proportion("error_rate", baseline.num_requests, baseline.num_errors,
                                 canary.num_requests, canary.num_errors, checks.error_rate_max_increase))
    if checks.deadline_miss_max_increase is not None:
        tests.append(_proportion("deadline_misses", baseline.num_requests, baseline.num_deadline_misses,
                                 canary.num_requests, canary.num_deadline_misses, checks.deadline_miss_max_increase))
    if checks.latency_max_ratio is not None:
        for name in _latency_names(baseline, canary, own_work_only=step.shadow):
            tests.extend(_latency(name, baseline.latencies(name), canary.latencies(name), checks.latency_max_ratio,
                                  checks.latency_min_increase_ms / 1000))
    alpha = (1 - policy.confidence) / max(1, len(tests))
    results = [CheckResult(name, b, c, p, p < alpha) for name, b, c, p in tests]
    if checks.min_agreement is not None and canary.num_compared:
        failed = stats.agreement_below(canary.num_agreed, canary.num_compared, checks.min_agreement,
                                       policy.confidence)
        results.append(CheckResult("agreement", f">= {checks.min_agreement:.1%}",
                                   f"{canary.num_agreed}/{canary.num_compared}", None, failed))
    golden_passed = True
    if checks.golden is not None:
        results.append(_golden(len(checks.golden.cases), golden))
        golden_passed = golden is not None and not golden.mismatches
    num_canary = canary.num_compared if step.shadow and canary.num_compared else canary.num_requests
    if any(r.failed for r in results):
        verdict = Verdict.ROLL_BACK
    elif num_canary >= policy.min_requests and elapsed_s >= policy.min_duration_s and golden_passed:
        verdict = Verdict.ADVANCE
    else:
        verdict = Verdict.WAIT
    return Judgement(verdict, tuple(results), baseline.num_requests, num_canary, elapsed_s, alpha)


def _golden(num_cases: int, outcome: GoldenOutcome | None) -> CheckResult:
    if outcome is None:
        return CheckResult("golden", f"{num_cases} cases", "not run yet in this step", None, False)
    answered = f"{outcome.num_passed}/{outcome.num_cases} right"
    if outcome.mismatches:
        answered += ": " + " / ".join(outcome.mismatches[:3])  # not "; ", which separates the checks
    return CheckResult("golden", f"{num_cases} cases", answered, None, bool(outcome.mismatches))


def _latency_names(baseline: Window, canary: Window, own_work_only: bool) -> list[str]:
    names = [END_TO_END] + [n for n in canary.latency_names() if n != END_TO_END]
    if own_work_only:
        names = [n for n in names if n.startswith(OWN_WORK_PREFIX)]
    return [n for n in names
            if len(baseline.latencies(n)) >= MIN_LATENCY_SAMPLES and len(canary.latencies(n)) >= MIN_LATENCY_SAMPLES]


def _proportion(name: str, n_base: int, base_events: int, n_canary: int, canary_events: int,
                max_increase: float) -> tuple[str, str, str, float]:
    p = stats.proportion_worse(n_base, base_events, n_canary, canary_events, max_increase)
    return name, _rate(base_events, n_base), _rate(canary_events, n_canary), p


def _latency(name: str, baseline_s: list[float], canary_s: list[float],
             max_ratio: float, min_increase_s: float) -> list[tuple[str, str, str, float]]:
    shift = stats.shift_worse(baseline_s, canary_s, max_ratio, min_increase_s)
    median = (f"latency:{name}", _ms(stats.quantile(baseline_s, 0.5)), _ms(stats.quantile(canary_s, 0.5)), shift)
    tail = stats.tail_worse(baseline_s, canary_s, max_ratio, min_increase_s=min_increase_s)
    p99 = (f"p99:{name}", _ms(stats.quantile(baseline_s, stats.TAIL_QUANTILE)),
           _ms(stats.quantile(canary_s, stats.TAIL_QUANTILE)), tail)
    return [median, p99]


def _rate(events: int, n: int) -> str:
    return f"{events / n:.2%}" if n else "-"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
