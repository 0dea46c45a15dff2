"""Percentile confidence intervals: the exact percentile bootstrap agrees with resampling, holds the
estimate, and narrows with more data."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.confidence import overlap, percentile_interval, percentile_intervals_ms


@pytest.mark.parametrize("percentile", [50.0, 90.0, 99.0])
def test_exact_interval_matches_a_resampled_bootstrap(percentile):
    values = np.arange(1, 401, dtype=np.float64)  # x_(j) = j, so bounds read as ranks
    rng = np.random.default_rng(5)
    m = int(np.ceil(percentile / 100 * len(values)))
    resampled = np.sort(rng.choice(values, size=(3000, len(values))), axis=1)[:, m - 1]
    brute_low, brute_high = np.quantile(resampled, [0.025, 0.975], method="inverted_cdf")
    low, high = percentile_interval(values, percentile)
    assert abs(low - brute_low) <= 2 and abs(high - brute_high) <= 2  # ranks; 3000 resamples are noisy


def test_interval_holds_the_estimate_and_narrows_with_more_values():
    rng = np.random.default_rng(2)
    small = np.sort(rng.exponential(10.0, 200))
    large = np.sort(rng.exponential(10.0, 20_000))
    for values in (small, large):
        low, high = percentile_interval(values, 99.0)
        estimate = values[int(np.ceil(0.99 * len(values))) - 1]
        assert low <= estimate <= high
    assert np.subtract(*percentile_interval(large, 99.0)[::-1]) < np.subtract(*percentile_interval(small, 99.0)[::-1])


def test_one_value_and_the_extreme_tail_of_few_values():
    assert percentile_interval(np.array([7.0]), 99.0) == (7.0, 7.0)
    low, high = percentile_interval(np.arange(1.0, 101.0), 99.9)
    assert high == 100.0 and low < 100.0  # p99.9 of 100 values: up to the max, never past it
    with pytest.raises(ValueError, match="at least one"):
        percentile_interval(np.array([]), 50.0)


def test_intervals_in_ms_per_percentile_and_overlap():
    cis = percentile_intervals_ms([1000.0 * i for i in range(1, 1001)])
    assert set(cis) == {"p50", "p90", "p99", "p99.9"}
    assert all(low <= high for low, high in cis.values()) and cis["p50"][0] < 500 < cis["p50"][1]
    assert percentile_intervals_ms([]) == {}
    assert overlap([1, 3], [3, 4]) and overlap([1, 5], [2, 3]) and not overlap([1, 2], [2.5, 3])
