"""bench_slo's process placement: which cores the worker and the rest get, and pinning every thread."""

from __future__ import annotations

import os
import threading

import pytest

from bench.overload.placement import Placement, apply, describe, pin_process, split_cores


def test_pinned_gives_the_worker_the_last_core_and_the_rest_the_others():
    assert split_cores({0, 1}) == (frozenset({1}), frozenset({0}))
    assert split_cores([3, 0, 2, 1]) == (frozenset({3}), frozenset({0, 1, 2}))


def test_pinned_needs_two_cores():
    with pytest.raises(ValueError, match="at least 2 cores"):
        split_cores({0})


def test_pinning_moves_every_thread_of_the_process():
    cores = frozenset(os.sched_getaffinity(0))  # the cores it already has: the test changes nothing
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert pin_process(os.getpid(), cores) >= 2
        assert describe({"me": os.getpid()}) == {"me": sorted(cores)}
    finally:
        release.set()
        thread.join()


def test_shared_placement_pins_nothing():
    assert apply(Placement.SHARED, [os.getpid()], []) == {"placement": "shared"}
