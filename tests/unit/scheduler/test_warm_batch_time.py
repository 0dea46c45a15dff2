"""The batcher's batch-time estimates seeded by a worker's warm-up (WorkerCapacity.warm_batch_time_us):
a cold first batch on a fresh mesh is not scaled up to a full batch, and measured batches take over."""

from __future__ import annotations

import math

import pytest

from infermesh.v1 import common_pb2, scheduler_pb2
from services.scheduler import attach_codec
from services.scheduler.classify_pool import ClassifyPool
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import Priority
from services.scheduler.worker_link import WorkerLink

from .conftest import make_batcher, tenant

WARM_FULL_BATCH_S = 0.030


def seeded(clock, **over):
    batcher = make_batcher(clock, workers={}, max_batch_size=16, **over)
    batcher.add_worker("w1", 16, warm_batch_time_s=WARM_FULL_BATCH_S)
    return batcher


def run_batch(clock, batcher, size: int, took_s: float) -> None:
    for i in range(size):
        batcher.submit(f"img{i}", tenant(), deadline_s=None)
    batch = batcher.next_batch()
    assert len(batch.items) == size
    clock.advance(took_s)
    batcher.complete(batch.batch_id)


def test_a_warm_full_batch_time_stands_for_every_size_before_any_batch_is_measured(clock):
    batcher = seeded(clock)
    assert [batcher.estimate_batch_time_s(size) for size in range(1, 17)] == [WARM_FULL_BATCH_S] * 16
    for i in range(32):
        batcher.submit(f"img{i}", tenant(), deadline_s=None)
    # Two full batches ahead of a new request, at the warm figure (not the config's initial guess).
    assert batcher.estimated_queue_time_s(Priority.STANDARD) == pytest.approx(2 * WARM_FULL_BATCH_S)


def test_a_slow_lone_first_batch_is_not_scaled_up_to_a_full_batch(clock):
    batcher = seeded(clock)
    run_batch(clock, batcher, 1, took_s=0.5)  # a cold worker's first request: lazy init, first decode
    assert batcher.estimate_batch_time_s(16) == pytest.approx(WARM_FULL_BATCH_S)
    # Capped at the warm full batch: once warm, a batch no larger takes no longer.
    assert batcher.estimate_batch_time_s(1) == pytest.approx(WARM_FULL_BATCH_S)


def test_a_worker_that_declares_no_warm_time_is_estimated_as_before(clock):
    batcher = make_batcher(clock, workers={"w1": 16}, max_batch_size=16)
    run_batch(clock, batcher, 1, took_s=0.5)
    assert batcher.estimate_batch_time_s(1) == pytest.approx(0.5)
    assert batcher.estimate_batch_time_s(16) == pytest.approx(16 * 0.5)  # scaled linearly from size 1


def test_measured_batches_take_over_from_the_warm_figure(clock):
    batcher = seeded(clock, batch_time_ewma_alpha=0.5)
    run_batch(clock, batcher, 16, took_s=0.010)
    assert batcher.estimate_batch_time_s(16) == pytest.approx(0.010)  # replaced outright, not averaged in
    run_batch(clock, batcher, 16, took_s=0.050)
    assert batcher.estimate_batch_time_s(16) == pytest.approx(0.030)  # then the EWMA, as for any size
    # Only the first batch is held to the warm figure: later ones count as measured.
    run_batch(clock, batcher, 4, took_s=0.2)
    assert batcher.estimate_batch_time_s(4) == pytest.approx(0.2)
    assert batcher.estimate_batch_time_s(8) == pytest.approx(0.030)  # borrowed from size 16


def test_a_later_workers_warm_figure_fills_only_unmeasured_sizes(clock):
    batcher = seeded(clock)
    batcher.add_worker("w2", 8, warm_batch_time_s=0.020)
    batcher.add_worker("w3", 16, warm_batch_time_s=0.040)
    assert batcher.estimate_batch_time_s(8) == pytest.approx(0.020)
    assert batcher.estimate_batch_time_s(16) == pytest.approx(0.040)  # the slower of two warm figures
    batcher.drain_worker("w2")
    batcher.drain_worker("w3")
    run_batch(clock, batcher, 16, took_s=0.010)
    batcher.add_worker("w4", 16, warm_batch_time_s=0.050)
    assert batcher.estimate_batch_time_s(16) == pytest.approx(0.010)  # a measurement outranks a warm figure


@pytest.mark.parametrize("warm_s", [0.0, -0.01, math.inf, math.nan])
def test_a_warm_time_must_be_positive_and_finite(clock, warm_s):
    batcher = make_batcher(clock, workers={})
    with pytest.raises(ValueError, match="warm_batch_time_s must be > 0 and finite"):
        batcher.add_worker("w1", 8, warm_batch_time_s=warm_s)


async def test_a_workers_declared_warm_time_reaches_the_pools_pressure_report(clock):
    wire = scheduler_pb2.WorkerHello(
        worker_id="w1", model=common_pb2.ModelRef(name="digits", version="1"), kind=common_pb2.MODEL_KIND_CLASSIFIER,
        capacity=scheduler_pb2.WorkerCapacity(max_batch_size=16, warm_batch_time_us=25_000), protocol_version=1)
    hello = attach_codec.decode_hello(wire)
    assert hello.capacity.warm_batch_time_s == pytest.approx(0.025)
    pool = ClassifyPool(hello.model, hello, SchedulerConfig(), clock=clock)
    pool.add_worker(WorkerLink(hello))
    # A lower bound for the gateway's deadline check: the full batch's time shared by its 16 items.
    assert pool.pressure().min_service_time_s == pytest.approx(0.025 / 16)
    older = attach_codec.decode_hello(scheduler_pb2.WorkerHello(capacity=scheduler_pb2.WorkerCapacity(max_batch_size=16)))
    assert older.capacity.warm_batch_time_s == 0.0  # unknown: the batcher keeps its initial guess


def test_the_least_service_time_is_a_lower_bound_until_a_lone_request_is_measured(clock):
    """The gateway refuses a deadline below it: a warm full batch's whole time would refuse requests a lone
    batch serves in a fraction of it."""
    assert make_batcher(clock, workers={}, initial_batch_time_s=0.05).min_service_time_s() == pytest.approx(0.05)
    batcher = seeded(clock)
    assert batcher.min_service_time_s() == pytest.approx(WARM_FULL_BATCH_S / 16)
    run_batch(clock, batcher, 4, took_s=0.004)
    assert batcher.min_service_time_s() == pytest.approx(0.004 / 4), "the least share per item of a known size"
    run_batch(clock, batcher, 1, took_s=0.006)
    assert batcher.min_service_time_s() == pytest.approx(0.006), "measured: the batch of one's own time"
