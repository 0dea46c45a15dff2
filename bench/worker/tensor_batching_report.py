"""bench_tensor_batching's figures, read: runs of several per model and arm, their medians, the ratio
and whether the target is met, and the tables. Pure: no timing, no processes.

The target (issue 34, "Batching pays"): dynamic batching on against off at saturation, requests/s of
the medians >= 3x, with the batching-on arm's p99 (median of its runs) under the knee bench's 100 ms
SLO. Every run's figure and the load average beside it stay in the report.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from bench.harness.stats import ratio
from bench.harness.tables import markdown_table

SLO_P99_MS = 100.0  # bench_tensor_knee's e2e SLO for the same model class
TARGET_SPEEDUP = 3.0
ARMS = ("batching on", "batching off")


@dataclass(frozen=True)
class LoadRun:
    """One closed-loop window against one mesh."""

    requests_per_s: float  # completed in the window, not shed
    p50_ms: float
    p99_ms: float
    num_requests: int
    num_shed: int  # refused by the gateway's adaptive limit (RESOURCE_EXHAUSTED)
    load_1m: float  # the machine's 1-minute load average as the window began
    worker_cores: float  # the worker process's CPU seconds per second over the window
    mean_batch_size: float  # requests per batch the worker ran over the window (warm-up included)
    lag_p99_ms: float  # the load generator's event-loop lag: how late a 5 ms timer fired, p99
    lag_max_ms: float


@dataclass(frozen=True)
class Direct:
    """The model called in one process (ONNX Runtime, one thread) and through the mesh at batch 1."""

    per_item_ms: Mapping[int, float]  # batch size -> median ms per item, called directly
    # One caller, batch 1, sequential, median ms per request: through the batching-off mesh (the
    # overhead's), and through the batching-on one (an idle worker takes a lone request at once).
    mesh_ms: float
    batching_mesh_ms: float

    @property
    def overhead_ms(self) -> float:
        return self.mesh_ms - self.per_item_ms[1]


def arm_summary(runs: Sequence[LoadRun]) -> dict:
    return {"median_requests_per_s": statistics.median(r.requests_per_s for r in runs),
            "median_p50_ms": statistics.median(r.p50_ms for r in runs),
            "median_p99_ms": statistics.median(r.p99_ms for r in runs),
            "runs": [asdict(r) for r in runs]}


def model_summary(runs: Mapping[str, Sequence[LoadRun]]) -> dict:
    """`runs`: each arm's runs, in the order they ran (run i of both arms ran back to back)."""
    on, off = (arm_summary(runs[arm]) for arm in ARMS)
    speedup = ratio(on["median_requests_per_s"], off["median_requests_per_s"])
    paired = [ratio(a.requests_per_s, b.requests_per_s) for a, b in zip(runs[ARMS[0]], runs[ARMS[1]], strict=True)]
    p99_within = on["median_p99_ms"] < SLO_P99_MS
    return {ARMS[0]: on, ARMS[1]: off, "speedup": speedup, "speedup_by_run": paired,
            "on_p99_within_slo": p99_within,
            "every_on_run_p99_within_slo": all(r.p99_ms < SLO_P99_MS for r in runs[ARMS[0]]),
            "met": speedup >= TARGET_SPEEDUP and p99_within}


def load_table(summaries: Mapping[str, dict]) -> str:
    rows = []
    for model, summary in summaries.items():
        for arm in ARMS:
            figures = summary[arm]
            runs = figures["runs"]
            rows.append((model, arm, figures["median_requests_per_s"], _each(runs, "requests_per_s"),
                         figures["median_p50_ms"], figures["median_p99_ms"], _each(runs, "p99_ms"),
                         sum(r["num_shed"] for r in runs), _each(runs, "mean_batch_size", "{:.1f}"),
                         _each(runs, "worker_cores", "{:.2f}"),
                         _each(runs, "load_1m", "{:.1f}"), _each(runs, "lag_p99_ms", "{:.1f}")))
    return markdown_table(("model", "batching", "req/s (median)", "req/s by run", "p50 ms", "p99 ms",
                           "p99 ms by run", "shed", "batch size by run", "worker cores by run", "load 1m by run",
                           "client lag p99 ms by run"), rows)


def verdict_lines(summaries: Mapping[str, dict]) -> list[str]:
    lines = []
    for model, s in summaries.items():
        paired = " / ".join(f"{v:.2f}" for v in s["speedup_by_run"])
        lines.append(f"{model}: batching on / off {s['speedup']:.2f}x (medians; by run {paired}), on-arm p99 "
                     f"{s[ARMS[0]]['median_p99_ms']:.0f} ms vs SLO {SLO_P99_MS:.0f} ms: "
                     f"{'met' if s['met'] else 'not met'} (target >= {TARGET_SPEEDUP:.0f}x)")
    return lines


def direct_table(directs: Mapping[str, Direct]) -> str:
    sizes = sorted({b for d in directs.values() for b in d.per_item_ms})
    rows = [(model, *(d.per_item_ms.get(b, float("nan")) for b in sizes), d.mesh_ms, d.overhead_ms,
             f"{d.overhead_ms / d.mesh_ms:.0%}", d.batching_mesh_ms) for model, d in directs.items()]
    return markdown_table(("model", *(f"direct ms/item, batch {b}" for b in sizes), "mesh ms, batch 1",
                           "mesh overhead ms", "overhead share", "mesh ms, batch 1, batching on"), rows)


def direct_report(direct: Direct) -> dict:
    return {"direct_ms_per_item_by_batch": {str(b): ms for b, ms in direct.per_item_ms.items()},
            "mesh_ms": direct.mesh_ms, "mesh_overhead_ms": direct.overhead_ms,
            "batching_mesh_ms": direct.batching_mesh_ms}


def _each(runs: Sequence[dict], key: str, fmt: str = "{:.0f}") -> str:
    return " / ".join(fmt.format(r[key]) for r in runs)
