"""Workers given several schedulers, real processes: a model's workers spread one per scheduler, and
when a scheduler dies (SIGKILL) or drains (SIGTERM) its worker attaches to the other at once."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from tools.testbed.processes import ServiceProcess, free_port, running_mesh, wait_until
from tools.testbed.scheduler_fixtures import (
    CLASSIFIER,
    GENERATOR,
    generate_request,
    pressure_of,
    scheduler_stub,
    wait_for_workers,
)

pytestmark = pytest.mark.integration


def workers_of(address: str, model) -> int:
    with scheduler_stub(address) as stub:
        pressure = pressure_of(stub, model)
    return pressure.num_workers if pressure is not None else 0


def num_workers(address: str) -> int:
    return workers_of(address, GENERATOR)


def start_spread_mesh(mesh, scheduler_args: tuple[str, ...] = (), worker_args: tuple[str, ...] = ()):
    """Two schedulers, then two toy-generator workers given both, the second once the first attached."""
    first = mesh.start_scheduler(*scheduler_args)
    second = mesh.start_scheduler(*scheduler_args)
    both = f"{first.address},{second.address}"
    for i in range(2):
        mesh.start_worker("toy-generator", "--scheduler-address", both, *worker_args, name=f"worker-{i}")
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
    """SIGSTOP: no reset, no goodbye, only unanswered pings tell the worker: every 2 s here, with 0.67 s
    for the answer (15 s + 5 s by default: the same mechanism, an operator's choice of period)."""
    with running_mesh(tmp_path) as mesh:
        first, second = start_spread_mesh(mesh, scheduler_args=("--keepalive-min-ping-interval-ms", "1000"),
                                          worker_args=("--attach-keepalive-ms", "2000"))
        began = time.monotonic()
        first.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: num_workers(second.address) == 2, timeout_s=30, interval_s=0.1,
                       message="both workers on the scheduler that still answers")
            took_s = time.monotonic() - began
        finally:
            first.signal(signal.SIGCONT)
    print(f"moved {took_s:.1f} s after SIGSTOP")
    assert took_s < 10, "noticed within a ping period and its timeout (2.7 s) plus a re-dial"


def test_a_draining_scheduler_lets_idle_workers_go_at_once_and_busy_ones_after_the_handover(tmp_path):
    """The calls a draining scheduler refuses go to the other one, which needs workers for them: an
    idle classifier worker moves at once, a generator worker running streams after their handover."""
    second_port = free_port()
    with running_mesh(tmp_path) as mesh:
        first = mesh.start_scheduler("--drain-grace-ms", "2500", "--drain-grace-s", "10")
        both = f"{first.address},127.0.0.1:{second_port}"  # the second is not up yet: both attach to the first
        mesh.start_worker("toy-classifier", "--scheduler-address", both, name="classifier")
        mesh.start_worker("toy-generator", "--toy-compute-ms", "20", "--scheduler-address", both, name="generator")
        second = ServiceProcess("second", "scheduler", second_port, [], dict(mesh.env), tmp_path / "second.log")
        mesh.processes.append(second.start())
        second.wait_serving()
        with scheduler_stub(first.address) as stub:
            wait_for_workers(stub, CLASSIFIER, 1)
            wait_for_workers(stub, GENERATOR, 1)
            streams = [stub.Generate(generate_request(f"long{i}", 400), timeout=30) for i in range(2)]
            for stream in streams:
                next(stream)  # running
            began = time.monotonic()
            first.signal(signal.SIGTERM)
            wait_until(lambda: workers_of(second.address, CLASSIFIER) == 1, timeout_s=10, interval_s=0.01,
                       message="the classifier worker on the second scheduler")
            classifier_moved_s = time.monotonic() - began
            wait_until(lambda: workers_of(second.address, GENERATOR) == 1, timeout_s=10, interval_s=0.01,
                       message="the generator worker on the second scheduler")
            generator_moved_s = time.monotonic() - began
            for stream in streams:
                with pytest.raises(grpc.RpcError) as ended:
                    list(stream)
                assert ended.value.details() == "scheduler draining: stream handed over"
    print(f"classifier worker moved after {classifier_moved_s * 1000:.0f} ms, "
          f"generator worker after {generator_moved_s * 1000:.0f} ms")
    assert classifier_moved_s < 2.0
    assert generator_moved_s >= 2.5, "the generator worker stayed while its streams ran"


def test_workers_all_on_one_scheduler_rebalance_onto_a_new_one_and_stay(tmp_path):
    """Both workers attached to the only scheduler up; a second starts (a restart, a roll): one of
    them moves there, gracefully, and the counts stay 1/1."""
    second_port = free_port()
    with running_mesh(tmp_path) as mesh:
        first = mesh.start_scheduler()
        both = f"{first.address},127.0.0.1:{second_port}"
        for i in range(2):
            mesh.start_worker("toy-generator", "--scheduler-address", both, "--rebalance-interval-s", "0.5",
                              name=f"worker-{i}")
        wait_until(lambda: num_workers(first.address) == 2, timeout_s=15, message="both on the first scheduler")
        second = ServiceProcess("second", "scheduler", second_port, [], dict(mesh.env), tmp_path / "second.log")
        mesh.processes.append(second.start())
        second.wait_serving()
        began = time.monotonic()
        wait_until(lambda: (num_workers(first.address), num_workers(second.address)) == (1, 1), timeout_s=20,
                   interval_s=0.05, message="one worker on each scheduler")
        took_s = time.monotonic() - began
        counts = set()
        for _ in range(20):  # 2 s: four rebalance checks per worker
            counts.add((num_workers(first.address), num_workers(second.address)))
            time.sleep(0.1)
    print(f"rebalanced {took_s:.2f} s after the second scheduler served")
    assert counts == {(1, 1)}, "the workers stay put once even"
