"""One-sided tests that a canary is worse than its baseline, each accounting for sample size.

A rollout step is judged on a few hundred requests at most, often a few dozen: a bare threshold
("canary error rate > 1 %") fires on one unlucky error out of twenty and misses a real regression
hidden in noise. Each test here answers "is the canary worse by more than the tolerance, with
this much evidence?" as a p-value; the caller compares it with its significance level.

  proportion_worse   error rate, deadline misses: two-proportion z-test of
                     canary_rate - baseline_rate > max_increase (pooled variance)
  shift_worse        latency: Mann-Whitney U of canary > max(baseline x max_ratio, baseline +
                     min_increase) (tie-corrected normal approximation); robust to outliers, no
                     distribution assumed
  tail_worse         p99: of the canary's samples, how many exceed that bound on the baseline's p99;
                     under "not worse" each does with chance <= 1 %, so the count is binomial
  agreement_below    shadow output agreement: the Wilson upper bound of the agreement rate is
                     below the minimum (conclusively below, not just one disagreement)

No I/O, no clock: plain numbers in, plain numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

TAIL_QUANTILE = 0.99


def normal_sf(z: float) -> float:
    """P(Z > z) for a standard normal Z."""
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def normal_quantile(p: float) -> float:
    """z with P(Z <= z) = p, 0 < p < 1 (bisection on erfc: exact enough for significance levels)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"normal_quantile: p must be in (0, 1), got {p}")
    low, high = -40.0, 40.0
    for _ in range(200):
        mid = (low + high) / 2
        if 1.0 - normal_sf(mid) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def proportion_worse(num_baseline: int, baseline_events: int, num_canary: int, canary_events: int,
                     max_increase: float = 0.0) -> float:
    """p-value of "the canary's event rate exceeds the baseline's by more than max_increase".

    1.0 (no evidence) when either side has no samples or the canary's rate is not above the
    baseline's plus the tolerance."""
    if num_baseline <= 0 or num_canary <= 0:
        return 1.0
    p_base, p_canary = baseline_events / num_baseline, canary_events / num_canary
    difference = p_canary - p_base - max_increase
    if difference <= 0:
        return 1.0
    pooled = (baseline_events + canary_events) / (num_baseline + num_canary)
    variance = pooled * (1 - pooled) * (1 / num_baseline + 1 / num_canary)
    if variance <= 0:
        # Every sample on one side an event, none on the other: as strong as evidence gets.
        return 0.0
    return normal_sf(difference / math.sqrt(variance))


def worse_bound(baseline_s: float, max_ratio: float, min_increase_s: float = 0.0) -> float:
    """The latency a canary must exceed to be worse than `baseline_s`: by the ratio and the margin."""
    return max(baseline_s * max_ratio, baseline_s + min_increase_s)


def shift_worse(baseline_s: Sequence[float], canary_s: Sequence[float], max_ratio: float = 1.0,
                min_increase_s: float = 0.0) -> float:
    """p-value of "canary latencies are stochastically larger than the baseline's, each raised to
    worse_bound()" (Mann-Whitney U, one-sided, normal approximation with tie correction)."""
    n1, n2 = len(canary_s), len(baseline_s)
    if n1 == 0 or n2 == 0:
        return 1.0
    scaled = [worse_bound(b, max_ratio, min_increase_s) for b in baseline_s]
    ranked = sorted([(v, 1) for v in canary_s] + [(v, 0) for v in scaled])
    rank_sum_canary, tie_term, i = 0.0, 0.0, 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        mean_rank = (i + j) / 2 + 1
        rank_sum_canary += mean_rank * sum(1 for k in range(i, j + 1) if ranked[k][1] == 1)
        ties = j - i + 1
        tie_term += ties**3 - ties
        i = j + 1
    u_canary = rank_sum_canary - n1 * (n1 + 1) / 2
    n = n1 + n2
    variance = n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))) if n > 1 else 0.0
    if variance <= 0:
        return 1.0
    z = (u_canary - n1 * n2 / 2 - 0.5) / math.sqrt(variance)  # 0.5: continuity correction
    return normal_sf(z)


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def binomial_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    # Summed in log space: n is a step's sample count, up to a few thousand.
    log_p, log_q = math.log(p), math.log1p(-p)
    terms = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
             for i in range(k, n + 1)]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


def tail_worse(baseline_s: Sequence[float], canary_s: Sequence[float], max_ratio: float = 1.0,
               q: float = TAIL_QUANTILE, min_baseline: int = 100, min_increase_s: float = 0.0) -> float:
    """p-value of "the canary's q-quantile exceeds worse_bound(the baseline's)": the count of canary
    samples above that bound against Binomial(n, 1 - q). 1.0 while the baseline has fewer than
    `min_baseline` samples (its p99 would be its maximum, i.e. noise)."""
    if len(baseline_s) < min_baseline or not canary_s:
        return 1.0
    bound = worse_bound(quantile(baseline_s, q), max_ratio, min_increase_s)
    return binomial_sf(sum(1 for v in canary_s if v > bound), len(canary_s), 1.0 - q)


def wilson_bounds(successes: int, n: int, confidence: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion at two-sided `confidence`; (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    z = normal_quantile(1 - (1 - confidence) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def agreement_below(num_agreed: int, num_compared: int, min_agreement: float, confidence: float) -> bool:
    """Whether the agreement rate is conclusively below `min_agreement` (its upper bound is)."""
    return num_compared > 0 and wilson_bounds(num_agreed, num_compared, confidence)[1] < min_agreement
