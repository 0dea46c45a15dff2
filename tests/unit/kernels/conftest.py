"""Shared fixtures for the kernel tests: a seeded generator and a relative-norm comparison."""

from __future__ import annotations

import numpy as np
import pytest

FLOAT32_TOLERANCE = 1e-4


def _relative_error(got, want) -> float:
    got64 = np.asarray(got, dtype=np.float64)
    want64 = np.asarray(want, dtype=np.float64)
    assert got64.shape == want64.shape, f"shape {got64.shape} != {want64.shape}"
    assert np.all(np.isfinite(got64)), "output has NaN or inf"
    return float(np.linalg.norm(got64 - want64) / max(np.linalg.norm(want64), 1e-30))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20240611)


@pytest.fixture
def assert_close():
    """assert_close(got, want, tolerance=1e-4): relative Frobenius-norm error bound, never exact equality."""

    def check(got, want, tolerance: float = FLOAT32_TOLERANCE) -> None:
        error = _relative_error(got, want)
        assert error <= tolerance, f"relative error {error:.3g} > {tolerance:g}"

    return check
