"""Figures of the token fast path benchmark: pure functions over results, no grpc, no processes.

Per-token CPU from /proc readings, end-to-end figures from per-request results (latency from
the scheduled send), mesh/baseline ratios of one run, medians over runs, the targets of the
issue with "met?", and a py-spy speedscope profile reduced to its top functions.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from bench.harness import stats
from bench.harness.send_result import SendResult, lag_summary
from bench.harness.stats import quantile


def us_per_token(cpu_s: float, num_tokens: int) -> float:
    """CPU microseconds per token; NaN when no token was delivered."""
    return cpu_s * 1e6 / num_tokens if num_tokens > 0 else math.nan


def e2e_figures(results: Sequence[SendResult], elapsed_s: float) -> dict:
    """Latency quantiles (ms, from the scheduled send) of the successful streams, their tokens per
    second over `elapsed_s`, and the failures by status."""
    ok = [r for r in results if r.ok]
    latencies_ms = [r.latency_s * 1e3 for r in ok]
    ttfts_ms = [r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]
    num_tokens = sum(r.num_tokens for r in ok)
    lag = lag_summary(results, threshold_ms=math.inf)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": dict(Counter(r.status for r in results if not r.ok)),
        "error_examples": sorted({f"{r.status}: {r.message}" for r in results if not r.ok})[:3],
        "e2e_p50_ms": round(quantile(latencies_ms, 0.50), 1),
        "e2e_p99_ms": round(quantile(latencies_ms, 0.99), 1),
        "ttft_p50_ms": round(quantile(ttfts_ms, 0.50), 1),
        "num_tokens": num_tokens,
        "tokens_per_s": round(num_tokens / elapsed_s, 1) if elapsed_s > 0 else math.nan,
        # The load generator's own lag behind its schedule (open loops; a closed loop sends at once).
        "lag_p99_ms": round(lag.p99_ms, 2),
        "lag_max_ms": round(lag.max_ms, 2),
    }


def rate_window_s(open_loop: bool, duration_s: float, elapsed_s: float) -> float:
    """What tokens/s divides by: an open loop's span from the schedule's start to its last reply
    (saturated, the server is busy all along, so this is its service rate); a closed loop's window,
    since only streams that ended inside it count (the clients' last streams end after it)."""
    return elapsed_s if open_loop else duration_s


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator rounded to 3 places; NaN when either is missing or the denominator is 0."""
    return round(stats.ratio(numerator, denominator), 3)


def median_of(runs: Iterable[dict], figure: Callable[[dict], float]) -> float:
    """Median of `figure(run)` over the runs that have it and where it is a number."""
    values = []
    for run in runs:
        try:
            value = figure(run)
        except (KeyError, TypeError):
            continue
        if value is not None and not math.isnan(value):
            values.append(value)
    return statistics.median(values) if values else math.nan


@dataclass(frozen=True)
class Target:
    figure: str  # what the table row shows
    op: str  # "<=" or ">="
    bound: float
    unit: str = ""

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"target {self.figure!r}: op must be '<=' or '>=', got {self.op!r}")

    def met(self, value: float) -> str:
        """'yes', 'no', or 'n/a' when there is no figure."""
        if value is None or math.isnan(value):
            return "n/a"
        return "yes" if (value <= self.bound if self.op == "<=" else value >= self.bound) else "no"

    @property
    def text(self) -> str:
        return f"{self.op} {self.bound:g}{self.unit}"


@dataclass(frozen=True)
class FunctionShare:
    name: str  # "function (file:line)"
    self_share: float  # fraction of samples with this function on top
    total_share: float  # fraction of samples with this function anywhere on the stack


def speedscope_top(doc: dict, top_n: int = 15) -> tuple[int, list[FunctionShare], list[FunctionShare]]:
    """(samples, top functions by self share, top by total share) over every thread's profile of a
    speedscope document (py-spy --format speedscope: 'sampled' profiles, stacks root first).
    Functions are merged by name and file, not line, so a function counts once per sample; shares
    are of the samples' weights (py-spy: seconds each)."""
    frames = doc["shared"]["frames"]
    names = [f"{f['name']} ({_short_file(f.get('file', ''))})" for f in frames]
    self_weight: Counter[str] = Counter()
    total_weight: Counter[str] = Counter()
    num_samples, all_weight = 0, 0.0
    for profile in doc["profiles"]:
        if profile.get("type") != "sampled":
            continue
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if not stack:
                continue
            num_samples += 1
            all_weight += weight
            self_weight[names[stack[-1]]] += weight
            for name in {names[i] for i in stack}:
                total_weight[name] += weight
    if num_samples == 0:
        return 0, [], []

    def shares(weights: Counter[str]) -> list[FunctionShare]:
        return [FunctionShare(name, round(self_weight[name] / all_weight, 4),
                              round(total_weight[name] / all_weight, 4))
                for name, _ in weights.most_common(top_n)]

    return num_samples, shares(self_weight), shares(total_weight)


NO_OWNER = "(no services/ frame on the stack)"


def speedscope_owners(doc: dict, top_n: int = 15, marker: str = "/services/") -> list[tuple[str, float]]:
    """(function, share) of samples charged to their innermost project frame (a file containing
    `marker`): what a service function costs with everything it calls in libraries and C (protobuf,
    grpc, system calls), each sample counted once. Samples with no such frame go to NO_OWNER."""
    frames = doc["shared"]["frames"]
    owned = [marker in f.get("file", "") for f in frames]
    names = [f"{f['name']} ({_short_file(f.get('file', ''))})" for f in frames]
    weights: Counter[str] = Counter()
    for profile in doc["profiles"]:
        if profile.get("type") != "sampled":
            continue
        for stack, weight in zip(profile["samples"], profile["weights"], strict=True):
            if stack:
                owner = next((names[i] for i in reversed(stack) if owned[i]), NO_OWNER)
                weights[owner] += weight
    total = sum(weights.values())
    return [(name, round(w / total, 4)) for name, w in weights.most_common(top_n)] if total else []


def _short_file(path: str) -> str:
    """The path from the project's top package or site-packages on, else the file name."""
    for marker in ("/services/", "/bench/", "/site-packages/", "/infermesh/", "/lib/python"):
        if marker in path:
            return path[path.index(marker) + 1:]
    return path.rsplit("/", 1)[-1]


