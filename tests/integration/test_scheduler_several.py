"""Workers given several schedulers, real processes: a model's workers spread one per scheduler, and
when a scheduler dies (SIGKILL) or drains (SIGTERM) its worker attaches to the other at once."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.processes import running_mesh, wait_until
from tests.support.scheduler_fixtures import GENERATOR, pressure_of, scheduler_stub

pytestmark = pytest.mark.integration


def num_workers(address: str) -> int:
    with scheduler_stub(address) as stub:
        pressure = pressure_of(stub, GENERATOR)
    return pressure.num_workers if pressure is not None else 0


def start_spread_mesh(mesh):
    """Two schedulers, then two toy-generator workers given both, the second once the first attached."""
    first = mesh.start_scheduler()
    second = mesh.start_scheduler()
    both = f"{first.address},{second.address}"
    for i in range(2):
        mesh.start_worker("toy-generator", "--scheduler-address", both, name=f"worker-{i}")
        wait_until(lambda i=i: num_workers(first.address) + num_workers(second.address) == i + 1, timeout_s=15,
                   message=f"{i + 1} workers attached")
    return first, second


def test_workers_spread_one_per_scheduler(tmp_path):
    with running_mesh(tmp_path) as mesh:
        first, second = start_spread_mesh(mesh)
        assert (num_workers(first.address), num_workers(second.address)) == (1, 1)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_workers_scheduler_gone_it_attaches_to_the_other_within_a_second(tmp_path, sig):
    with running_mesh(tmp_path) as mesh:
        first, second = start_spread_mesh(mesh)
        began = time.monotonic()
        first.signal(sig)
        wait_until(lambda: num_workers(second.address) == 2, timeout_s=10, interval_s=0.01,
                   message="both workers on the surviving scheduler")
        took_s = time.monotonic() - began
        assert first.proc.wait(timeout=15) in (0, -signal.SIGKILL)
    print(f"re-attached {took_s * 1000:.0f} ms after {sig.name}")
    # ~20 ms on a quiet box; the bound leaves room for a CI box running other tests at once.
    assert took_s < 3, f"the worker took {took_s:.2f}s to attach to the other scheduler"


def test_a_frozen_scheduler_is_noticed_by_keepalive_and_its_worker_moves(tmp_path):
    """SIGSTOP: no reset, no goodbye, only unanswered pings (15 s + 5 s) tell the worker."""
    with running_mesh(tmp_path) as mesh:
        first, second = start_spread_mesh(mesh)
        began = time.monotonic()
        first.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: num_workers(second.address) == 2, timeout_s=30, interval_s=0.1,
                       message="both workers on the scheduler that still answers")
            took_s = time.monotonic() - began
        finally:
            first.signal(signal.SIGCONT)
    print(f"moved {took_s:.1f} s after SIGSTOP")
    assert took_s < 25
