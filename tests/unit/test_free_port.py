"""The testbed's free ports: pytest-xdist's workers draw from disjoint slices below the ephemeral range."""

from __future__ import annotations

import pytest

from tools.testbed import processes


@pytest.mark.parametrize("count", [2, 3, 4])
def test_each_xdist_worker_gets_its_own_slice_and_together_they_stay_in_the_range(monkeypatch, count):
    slices = []
    for index in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
        slices.append(processes._port_slice(20000, 32000))  # noqa: SLF001
    assert all(first < end for first, end in slices)
    assert all(a[1] <= b[0] for a, b in zip(slices, slices[1:], strict=False)), slices
    assert slices[0][0] >= 20000 and slices[-1][1] <= 32000


def test_outside_xdist_the_whole_range_is_used(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert processes._port_slice(20000, 32000) == (20000, 32000)  # noqa: SLF001
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert processes._port_slice(20000, 32000) == (20000, 32000)  # noqa: SLF001


def test_a_port_handed_out_is_in_this_workers_slice(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    low = processes._ephemeral_low()  # noqa: SLF001
    first, end = processes._port_slice(max(1024, low - 12000), low)  # noqa: SLF001
    assert all(first <= processes.free_port() < end for _ in range(5))
