"""bench/harness/stats.py: the one quantile every benchmark uses."""

from __future__ import annotations

import math

import pytest

from bench.harness.stats import quantile


def test_quantile_is_the_nearest_rank():
    values = list(range(1, 101))
    assert quantile(values, 0.5) == 50
    assert quantile(values, 0.99) == 99
    assert quantile(values, 1.0) == 100
    assert quantile(values, 0.0) == 1
    assert quantile([3.0], 0.99) == 3.0
    assert math.isnan(quantile([], 0.5))
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\], got 99"):
        quantile(values, 99)
