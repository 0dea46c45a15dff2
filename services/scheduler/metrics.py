"""The scheduler's Prometheus metrics (prometheus-client, the process's default registry).

Names and labels are a contract with dashboards and alerts; change them only together.
Label values: `model` is the model name; `priority` is critical | standard | sheddable;
`kind` is classify | generate; `code` is the gRPC status code name (OK, UNAVAILABLE, ...).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from services.scheduler.fair_queue import Priority
from services.scheduler.prefix_cache import PrefixCacheStats

# Seconds, from 0.5 ms to 60 s: scheduler queues range from sub-millisecond to overload.
_LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
_BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

QUEUE_DEPTH = Gauge(
    "infermesh_scheduler_queue_depth", "Requests waiting in the scheduler queue (classify items or waiting sequences).",
    ["model", "priority"],
)
QUEUE_TIME = Histogram(
    "infermesh_scheduler_queue_time_seconds",
    "Time from arrival at the scheduler until the request's batch was dispatched (classify) or its first step "
    "was scheduled (generate).",
    ["model", "priority"], buckets=_LATENCY_BUCKETS_S,
)
BATCH_SIZE = Histogram(
    "infermesh_scheduler_batch_size", "Requests per classify batch, or sequences per generate step.",
    ["model"], buckets=_BATCH_SIZE_BUCKETS,
)
STREAMS_HANDED_OVER = Counter(
    "infermesh_scheduler_streams_handed_over_total",
    "Generate streams a draining scheduler ended with UNAVAILABLE 'scheduler draining: stream handed over' "
    "after its drain grace, for the gateway to resume elsewhere.",
    ["model"],
)
RUNNING_SEQUENCES = Gauge(
    "infermesh_scheduler_running_sequences", "Generate sequences holding KV blocks, over the model's workers.", ["model"]
)
WAITING_SEQUENCES = Gauge(
    "infermesh_scheduler_waiting_sequences",
    "Generate sequences waiting for admission (new, preempted, or held for a worker).", ["model"],
)
KV_CACHE_USAGE = Gauge(
    "infermesh_scheduler_kv_cache_usage_ratio", "Fraction of a worker's KV blocks allocated, 0..1.",
    ["model", "worker"],
)
PREEMPTIONS = Counter(
    "infermesh_scheduler_preemptions_total", "Sequences preempted (blocks freed, recomputed later).", ["model"]
)
TTFT = Histogram(
    "infermesh_scheduler_time_to_first_token_seconds", "Generate: arrival at the scheduler until the first generated token (not for continuations).",
    ["model", "version"], buckets=_LATENCY_BUCKETS_S,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "infermesh_scheduler_time_per_output_token_seconds",
    "Generate, per finished request: (last token - first token) / (tokens - 1).",
    ["model", "version"], buckets=_LATENCY_BUCKETS_S,
)
INTER_TOKEN_LATENCY = Histogram(
    "infermesh_scheduler_inter_token_latency_seconds", "Generate: time between consecutive streamed tokens.",
    ["model"], buckets=_LATENCY_BUCKETS_S,
)
E2E_LATENCY = Histogram(
    "infermesh_scheduler_e2e_latency_seconds", "Arrival at the scheduler until the reply (or the last chunk).",
    ["model", "kind"], buckets=_LATENCY_BUCKETS_S,
)
REQUESTS = Counter(
    "infermesh_scheduler_requests_total", "Requests finished at the scheduler, by status code.",
    ["model", "tenant", "code"],
)
STEP_TIME = Histogram(
    "infermesh_scheduler_step_seconds", "Generate: one step, from the previous step's result to this one's.",
    ["model"], buckets=_LATENCY_BUCKETS_S,
)
STEP_OVERHEAD = Histogram(
    "infermesh_scheduler_step_overhead_seconds",
    "Generate: the part of a step that is not the worker's own time (scheduling, serialization, transport).",
    ["model"], buckets=_LATENCY_BUCKETS_S,
)
PIPELINED_STEPS = Counter(
    "infermesh_scheduler_pipelined_steps_total",
    "Generate steps sent before the previous step's result (--pipelined-steps; their decodes take its samples).",
    ["model"],
)
WORKERS = Gauge("infermesh_scheduler_attached_workers", "Workers attached and serving a model version.",
                ["model", "version"])
PREFIX_CACHE_QUERIED_TOKENS = Counter(
    "infermesh_scheduler_prefix_cache_queried_tokens_total",
    "Generate: tokens of the sequences admitted to a worker (new, preempted or moved), each a candidate for the "
    "prefix cache.", ["model", "worker"],
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "infermesh_scheduler_prefix_cache_hit_tokens_total",
    "Generate: of the queried tokens, those whose KV was reused from the worker's prefix cache, not computed.",
    ["model", "worker"],
)
PREFIX_CACHE_QUERIED_BLOCKS = Counter(
    "infermesh_scheduler_prefix_cache_queried_blocks_total",
    "Generate: full blocks of the admitted sequences that could be reused (all but the block of the last token).",
    ["model", "worker"],
)
PREFIX_CACHE_HIT_BLOCKS = Counter(
    "infermesh_scheduler_prefix_cache_hit_blocks_total", "Generate: of the queried blocks, those reused.",
    ["model", "worker"],
)
PREFIX_CACHE_BLOCKS = Gauge(
    "infermesh_scheduler_prefix_cache_blocks",
    "Generate: a worker's KV blocks holding a cached prefix (in use or free until evicted).", ["model", "worker"],
)
PREFIX_CACHE_EVICTIONS = Counter(
    "infermesh_scheduler_prefix_cache_evictions_total",
    "Generate: cached blocks whose page was taken for other tokens (least recently freed first).",
    ["model", "worker"],
)

PRIORITY_LABELS = {p: p.name.lower() for p in Priority}
_PREFIX_CACHE_COUNTERS = (PREFIX_CACHE_QUERIED_TOKENS, PREFIX_CACHE_HIT_TOKENS, PREFIX_CACHE_QUERIED_BLOCKS,
                          PREFIX_CACHE_HIT_BLOCKS, PREFIX_CACHE_EVICTIONS)


class PrefixCacheMetrics:
    """One worker's prefix cache series: its scheduler's monotonic counts, published as increments."""

    def __init__(self, model: str, worker: str) -> None:
        self._labels = (model, worker)
        self._counters = [counter.labels(model, worker) for counter in _PREFIX_CACHE_COUNTERS]
        self._blocks = PREFIX_CACHE_BLOCKS.labels(model, worker)
        self._published = [0] * len(self._counters)

    def publish(self, stats: PrefixCacheStats, num_cached_blocks: int, num_evictions: int) -> None:
        totals = (stats.num_queried_tokens, stats.num_hit_tokens, stats.num_queried_blocks, stats.num_hit_blocks,
                  num_evictions)
        for index, (counter, total) in enumerate(zip(self._counters, totals, strict=True)):
            if total > self._published[index]:
                counter.inc(total - self._published[index])
                self._published[index] = total
        self._blocks.set(num_cached_blocks)

    def remove(self) -> None:
        """The worker is gone, and its cache with it: no stale series."""
        for metric in (*_PREFIX_CACHE_COUNTERS, PREFIX_CACHE_BLOCKS):
            try:
                metric.remove(*self._labels)
            except KeyError:
                pass


class StepMetrics:
    """One model's generate step series, looked up once: its workers' step loops update them every step."""

    def __init__(self, model: str) -> None:
        self._step_time = STEP_TIME.labels(model)
        self._step_overhead = STEP_OVERHEAD.labels(model)
        self._batch_size = BATCH_SIZE.labels(model)
        self._preemptions = PREEMPTIONS.labels(model)
        self._pipelined = PIPELINED_STEPS.labels(model)

    def planned(self, num_seqs: int, num_preempted: int) -> None:
        """A step planned: its sequences (none: nothing to run) and the sequences it preempted."""
        if num_preempted:
            self._preemptions.inc(num_preempted)
        if num_seqs:
            self._batch_size.observe(num_seqs)

    def sent_ahead(self, num_steps: int) -> None:
        self._pipelined.inc(num_steps)

    def timed(self, step_s: float, worker_s: float, scheduler_gap_s: float) -> None:
        """One step's timing: what it took (its round trip, or its share of its command's), the worker's
        own time, and the scheduler's time from the previous result to this step's send."""
        self._step_time.observe(step_s + scheduler_gap_s)
        self._step_overhead.observe(max(0.0, step_s - worker_s) + scheduler_gap_s)


class GenerateGauges:
    """One model's generate sequences over its workers: running, waiting, and waiting by class."""

    def __init__(self, model: str) -> None:
        self._running = RUNNING_SEQUENCES.labels(model)
        self._waiting = WAITING_SEQUENCES.labels(model)
        self._queue_depth = {p: QUEUE_DEPTH.labels(model, label) for p, label in PRIORITY_LABELS.items()}

    def publish(self, num_running: int, num_waiting: int, num_waiting_of: Callable[[Priority], int]) -> None:
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        for priority, gauge in self._queue_depth.items():
            gauge.set(num_waiting_of(priority))


class WorkerGauges:
    """One generator worker's KV usage and prefix cache series."""

    def __init__(self, model: str, worker: str) -> None:
        self._labels = (model, worker)
        self._kv_usage = KV_CACHE_USAGE.labels(model, worker)
        self._cache = PrefixCacheMetrics(model, worker)

    def publish(self, kv_usage: float, stats: PrefixCacheStats, num_cached_blocks: int, num_evictions: int) -> None:
        self._kv_usage.set(kv_usage)
        self._cache.publish(stats, num_cached_blocks, num_evictions)

    def remove(self) -> None:
        """The worker is gone (and no other link serves under its id): no stale series."""
        try:
            KV_CACHE_USAGE.remove(*self._labels)
        except KeyError:
            pass
        self._cache.remove()


def observe_many(histogram, amount: float, count: int) -> None:
    """Records `count` observations of the same `amount` on a labelled Histogram child: one sum and
    one bucket increment (two locks) instead of `count` observe() calls. The step loop observes a
    step's inter-token gaps so: at 64 sequences they are 64 equal values per step.

    Reads prometheus-client's Histogram internals (_upper_bounds, _buckets, _sum, as of 0.x);
    tests/unit/scheduler/test_metrics_observe_many.py checks it exposes the same as observe() in a loop.
    """
    if count <= 0:
        return
    if count == 1:
        histogram.observe(amount)
        return
    # observe() counts `amount` in the first bucket whose upper bound is >= amount (the last is +Inf).
    histogram._sum.inc(amount * count)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, amount)].inc(count)
