"""Worker metrics (names are the contract in deploy/observability/metrics.yaml)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from infermesh.v1 import common_pb2, scheduler_pb2
from services.common.timings import from_proto
from services.worker.expired_items import DEADLINE_EXCEEDED

READY = Gauge("infermesh_worker_ready", "1 when the worker has loaded, warmed up and passed its golden check",
              ["model", "version"])
STAGE_SECONDS = Histogram(
    "infermesh_worker_stage_duration_seconds", "Time per batch or step spent in each worker stage",
    ["model", "stage"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
BATCH_SIZE = Histogram("infermesh_worker_batch_size", "Items per classify batch or sequences per step",
                       ["model", "kind"], buckets=(1, 2, 4, 8, 16, 32, 64, 128))
KV_BLOCKS_USED = Gauge("infermesh_worker_kv_blocks_used", "KV blocks holding pages of live sequences", ["model"])
THREADS = Gauge("infermesh_worker_threads", "torch/OpenMP/Numba threads the worker runs, from its CPU allocation "
                "(source: flag | OMP_NUM_THREADS | cgroup | affinity)", ["model", "source"])
GENERATED_TOKENS = Counter("infermesh_worker_generated_tokens_total", "Tokens sampled (rate = tokens/s)", ["model"])
# What each batch item or step sequence came to: ok (computed), expired (past its deadline on arrival,
# answered without compute) or failed (the runtime raised; the scheduler was told per item/sequence).
ITEMS = Counter("infermesh_worker_items_total", "Classify items and generate step sequences, by outcome",
                ["model", "kind", "outcome"])
MODEL_LOAD_SECONDS = Gauge("infermesh_worker_model_load_seconds",
                           "Time to load the weights, warm up and pass the golden check, at start", ["model", "version"])
# 1 for the state the worker is in, 0 for the others (Triton's model states, as a gauge per state).
MODEL_STATE = Gauge("infermesh_worker_model_state", "1 for the model's current state: loading, ready or draining",
                    ["model", "version", "state"])
MODEL_STATES = ("loading", "ready", "draining")


def set_model_state(model: str, version: str, state: str) -> None:
    for each in MODEL_STATES:
        MODEL_STATE.labels(model, version, each).set(1 if each == state else 0)
    READY.labels(model, version).set(1 if state == "ready" else 0)


def _observe_stages(model: str, timings: common_pb2.Timings) -> None:
    for stage in from_proto(timings):
        _stage_seconds(model, stage.stage).observe(stage.duration_us / 1e6)


# Each generate step observes ~7 series; labels() looks a child up under a lock every time (~1.5 us),
# so the children are kept (they live as long as their metric, and nothing here removes one).
@functools.cache
def _stage_seconds(model: str, stage: str) -> Histogram:
    return STAGE_SECONDS.labels(model, stage)


@dataclass(frozen=True)
class _StepSeries:
    batch_size: Histogram
    generated_tokens: Counter
    ok: Counter
    failed: Counter
    kv_blocks_used: Gauge


@functools.cache
def _step_series(model: str) -> _StepSeries:
    return _StepSeries(BATCH_SIZE.labels(model, "step"), GENERATED_TOKENS.labels(model),
                       ITEMS.labels(model, "sequence_step", "ok"), ITEMS.labels(model, "sequence_step", "failed"),
                       KV_BLOCKS_USED.labels(model))


def observe_kv_blocks(model: str, kv_blocks_used: int) -> None:
    _step_series(model).kv_blocks_used.set(kv_blocks_used)


def observe_batch(model: str, result: scheduler_pb2.BatchResult) -> None:
    """Items computed: an item answered DEADLINE_EXCEEDED before compute is not counted."""
    expired = sum(1 for item in result.items if item.error.code == DEADLINE_EXCEEDED)
    failed = sum(1 for item in result.items if item.error.code and item.error.code != DEADLINE_EXCEEDED)
    computed = len(result.items) - expired - failed
    for outcome, count in (("ok", computed), ("expired", expired), ("failed", failed)):
        if count:
            ITEMS.labels(model, "classify", outcome).inc(count)
    if computed + failed:
        BATCH_SIZE.labels(model, "classify").observe(computed + failed)
    _observe_stages(model, result.timings)


def observe_step(model: str, command: scheduler_pb2.RunStep, result: scheduler_pb2.StepResult,
                 kv_blocks_used: int) -> None:
    series = _step_series(model)
    series.batch_size.observe(len(command.seqs))
    _observe_stages(model, result.timings)
    ok = sum(1 for out in result.outputs if not out.HasField("error"))
    series.generated_tokens.inc(ok)
    series.ok.inc(ok)
    if len(result.outputs) > ok:
        series.failed.inc(len(result.outputs) - ok)
    series.kv_blocks_used.set(kv_blocks_used)
