"""Figures of the overload benchmark from per-request results: pure functions, no grpc.

Latency is measured from each request's *scheduled* send time (open loop, so a
late generator or a slow server is charged to the request, never hidden).
Goodput counts requests that succeeded within the deadline the benchmark set.
Stage coverage says how much of the end-to-end latency the servers' own stage
timings explain: the sum of the leaf stages (every stage but the `gateway` and
`scheduler` totals) over the latency, for the requests around the median and in
the tail.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from bench.harness.send_result import SendResult, lag_summary
from bench.harness.stats import quantile


def goodput_per_s(results: Sequence[SendResult], deadline_s: float, window_s: float) -> float:
    """Requests per second that succeeded within `deadline_s` of their scheduled send time."""
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return sum(1 for r in results if r.ok and r.latency_s <= deadline_s) / window_s


def coverage(results: Sequence[SendResult], q: float, band: float = 0.02) -> float:
    """Leaf-stage time over end-to-end latency for the successful requests whose latency ranks
    within `band` of quantile q (q = 1 - band and above: the tail). Sums, not a mean of ratios,
    so the slowest requests weigh as much as their time. NaN when there are none."""
    ok = sorted((r for r in results if r.ok), key=lambda r: r.latency_s)
    if not ok:
        return math.nan
    lo = max(0, math.floor((q - band) * len(ok)))
    hi = min(len(ok), max(lo + 1, math.ceil((q + band) * len(ok))))
    chosen = ok[lo:hi]
    latency_us = sum(r.latency_s for r in chosen) * 1e6
    return sum(r.leaf_stage_us for r in chosen) / latency_us if latency_us > 0 else math.nan


def error_examples(results: Iterable[SendResult]) -> dict[str, str]:
    """The first failure's details per status code: why requests failed, in the servers' words."""
    examples: dict[str, str] = {}
    for r in results:
        if not r.ok:
            examples.setdefault(r.status, r.message[:200])
    return dict(sorted(examples.items()))


def summarize(results: Sequence[SendResult], window_s: float, deadline_s: float, lag_threshold_ms: float) -> dict:
    """The figures every part reports for one tenant's (or all) measured requests."""
    ok = [r for r in results if r.ok]
    latencies_ms = [1000 * r.latency_s for r in ok]
    lag = lag_summary(results, lag_threshold_ms)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "error_examples": error_examples(results),
        "offered_per_s": len(results) / window_s,
        "throughput_per_s": len(ok) / window_s,
        "goodput_per_s": goodput_per_s(results, deadline_s, window_s),
        "p50_ms": quantile(latencies_ms, 0.5),
        "p99_ms": quantile(latencies_ms, 0.99),
        "coverage_p50": coverage(results, 0.5),
        "coverage_p99": coverage(results, 0.99),
        "lag_p50_ms": lag.p50_ms,
        "lag_p99_ms": lag.p99_ms,
        "lag_max_ms": lag.max_ms,
        "generator_fell_behind": lag.fell_behind,
    }


def summarize_streams(results: Sequence[SendResult], window_s: float, lag_threshold_ms: float) -> dict:
    """Stream figures: TTFT and end-to-end percentiles of the successful streams."""
    ok = [r for r in results if r.ok]
    ttft_ms = [1000 * r.ttft_s for r in ok if r.ttft_s is not None]
    e2e_ms = [1000 * r.latency_s for r in ok]
    lag = lag_summary(results, lag_threshold_ms)
    return {
        "num_streams": len(results),
        "num_ok": len(ok),
        "errors": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "error_examples": error_examples(results),
        "offered_per_s": len(results) / window_s,
        "completed_per_s": len(ok) / window_s,
        "output_tokens_per_s": sum(r.num_tokens for r in ok) / window_s,
        "ttft_p50_ms": quantile(ttft_ms, 0.5),
        "ttft_p99_ms": quantile(ttft_ms, 0.99),
        "e2e_p50_ms": quantile(e2e_ms, 0.5),
        "e2e_p99_ms": quantile(e2e_ms, 0.99),
        "coverage_p50": coverage(results, 0.5),
        "coverage_p99": coverage(results, 0.99),
        "lag_p99_ms": lag.p99_ms,
        "generator_fell_behind": lag.fell_behind,
    }


def by_tenant(results: Iterable[SendResult]) -> dict[str, list[SendResult]]:
    groups: dict[str, list[SendResult]] = {}
    for r in results:
        groups.setdefault(r.tenant, []).append(r)
    return groups
