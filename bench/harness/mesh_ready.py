"""A benchmark's mesh: what its workers run with, and waiting until every worker attached to its scheduler."""

from __future__ import annotations

import time

import grpc

from infermesh.v1 import scheduler_pb2, scheduler_pb2_grpc

# One compute thread per worker: the machine's cores are shared with the scheduler and the load.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
# tinylm's running sequences per step as `make up`, compose and Kubernetes run it (its manifest says 16).
TINYLM_MAX_NUM_SEQS = 32


def wait_attached(address: str, num_workers: int, timeout_s: float = 120.0) -> None:
    """Until the scheduler at `address` reports `num_workers` workers over its models."""
    give_up = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        while time.monotonic() < give_up:
            reply = stub.GetPressure(scheduler_pb2.GetPressureRequest(), timeout=5)
            if sum(m.num_workers for m in reply.models) >= num_workers:
                return
            time.sleep(0.05)
    raise TimeoutError(f"{num_workers} workers not attached to {address} within {timeout_s}s")

