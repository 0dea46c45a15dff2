"""Summaries of request records: percentiles (HdrHistogram), goodput, streams, stages, tails, windows.

Every function here is pure: records in, JSON-ready dicts out. Latency
percentiles come from an HdrHistogram in microseconds with 3 significant
digits, so a reported value is within 0.1% of the true order statistic.
Latency, stage and stream figures describe successful requests; failures are
counted by status code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from hdrh.histogram import HdrHistogram

from loadtest.confidence import CONFIDENCE, METHOD, percentile_intervals_ms
from loadtest.records import CLIENT_NETWORK, CLIENT_QUEUE, OTHER, RequestRecord
from loadtest.scenario import RequestKind, Slo

LOWEST_US = 1
HIGHEST_US = 3_600_000_000  # one hour
SIGNIFICANT_DIGITS = 3
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
PERCENTILE_KEYS = ("p50", "p90", "p99", "p99.9")
# Percentiles the CDF is drawn through: dense in the body, then one point per "nine".
CDF_PERCENTILES = (0.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 75.0, 80.0, 85.0, 90.0, 92.5, 95.0,
                   97.0, 98.0, 99.0, 99.5, 99.9, 99.95, 99.99, 100.0)
# Display order of stages: the order a request meets them.
STAGE_ORDER = (CLIENT_QUEUE, "admission", "queue_wait", "batch_wait", "prefill", "decode", "preprocess", "compute",
               "postprocess", "network", CLIENT_NETWORK, OTHER)


class LatencyHistogram:
    """An HdrHistogram of microseconds that reports milliseconds."""

    def __init__(self, values_us: Iterable[float] = ()) -> None:
        self._hist = HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)
        self._sum_us = 0  # the mean is kept exactly: hdrh's get_mean_value walks every bucket in Python
        for value in values_us:
            self.record_us(value)

    def record_us(self, value_us: float) -> None:
        value = min(max(round(value_us), 0), HIGHEST_US)
        self._hist.record_value(value)
        self._sum_us += value

    @property
    def count(self) -> int:
        return self._hist.get_total_count()

    def value_at_us(self, percentile: float) -> int:
        return self._hist.get_value_at_percentile(percentile)

    def lowest_equivalent_us(self, value_us: int) -> int:
        return self._hist.get_lowest_equivalent_value(value_us)

    def summary_ms(self) -> dict[str, float | int]:
        if self.count == 0:
            return {"count": 0}
        values = self._hist.get_percentile_to_value_dict([*PERCENTILES, 100.0])
        summary: dict[str, float | int] = {"count": self.count, "mean": _ms(self._sum_us / self.count),
                                           "min": _ms(self._hist.get_min_value())}
        summary.update({key: _ms(values[p]) for key, p in zip(PERCENTILE_KEYS, PERCENTILES, strict=True)})
        summary["max"] = _ms(self._hist.get_max_value())
        return summary

    def cdf_ms(self) -> list[list[float]]:
        """[percentile, ms] pairs for plotting the distribution."""
        if self.count == 0:
            return []
        values = self._hist.get_percentile_to_value_dict(list(CDF_PERCENTILES))
        return [[p, _ms(values[p])] for p in CDF_PERCENTILES]


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """Succeeded and within every bound the class sets (TTFT from the scheduled time)."""
    if not record.ok:
        return False
    if slo.e2e_ms is not None and record.latency_s * 1000 > slo.e2e_ms:
        return False
    if slo.ttft_ms is not None:
        ttft_s = record.ttft_s
        if ttft_s is None or ttft_s * 1000 > slo.ttft_ms:
            return False
    if slo.tpot_ms is not None:
        tpot_s = record.tpot_s
        if tpot_s is not None and tpot_s * 1000 > slo.tpot_ms:
            return False
    return True


def summarize_group(
    records: Sequence[RequestRecord],
    measured_s: float,
    slo_of: Callable[[RequestRecord], Slo],
    slo: Slo | None = None,
) -> dict:
    """Everything the report says about one slice of the traffic (a class, a tenant, all)."""
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    num_good = sum(meets_slo(r, slo_of(r)) for r in records)
    latency = LatencyHistogram(r.latency_s * 1e6 for r in ok)
    num = len(records)
    return {
        "num_requests": num,
        "num_ok": len(ok),
        "num_errors": len(errors),
        "errors": dict(sorted(Counter(r.status for r in errors).items())),
        "error_examples": _first_messages(errors),
        "offered_rps": _round(num / measured_s),
        "throughput_rps": _round(len(ok) / measured_s),
        "goodput_rps": _round(num_good / measured_s),
        "goodput_ratio": _round(num_good / num if num else 0.0, 4),
        "error_ratio": _round(len(errors) / num if num else 0.0, 4),
        "slo": slo.as_dict() if slo is not None else None,
        "latency_ms": latency.summary_ms(),
        "service_ms": LatencyHistogram(r.service_s * 1e6 for r in ok).summary_ms(),
        "cdf_ms": latency.cdf_ms(),
        "stream": summarize_streams([r for r in ok if r.kind is RequestKind.GENERATE], measured_s),
        "stages": stage_breakdown(ok),
        "tail": tail_attribution(ok, latency),
        "ci_ms": confidence_intervals(ok),
    }


def confidence_intervals(ok: Sequence[RequestRecord]) -> dict:
    """Each percentile's confidence interval (loadtest/confidence.py), for latency, service time and,
    over the streams among `ok`, TTFT, TPOT, ITL and e2e; a metric with no values is left out."""
    streams = [r for r in ok if r.kind is RequestKind.GENERATE]
    values_us = {
        "latency": [r.latency_s * 1e6 for r in ok],
        "service": [r.service_s * 1e6 for r in ok],
        "ttft": [r.ttft_s * 1e6 for r in streams if r.ttft_s is not None],
        "tpot": [r.tpot_s * 1e6 for r in streams if r.tpot_s is not None],
        "itl": [gap * 1e6 for r in streams for gap in r.itl_s],
        "e2e": [r.latency_s * 1e6 for r in streams],
    }
    out: dict = {"confidence": CONFIDENCE, "method": METHOD}
    for metric, values in values_us.items():
        if values:
            out[metric] = percentile_intervals_ms(values)
    return out


def summarize_streams(records: Sequence[RequestRecord], measured_s: float) -> dict | None:
    if not records:
        return None
    num_tokens = sum(r.num_output_tokens for r in records)
    return {
        "num_streams": len(records),
        "ttft_ms": LatencyHistogram(r.ttft_s * 1e6 for r in records if r.ttft_s is not None).summary_ms(),
        "server_ttft_ms": LatencyHistogram(r.server_ttft_us for r in records if r.server_ttft_us > 0).summary_ms(),
        "tpot_ms": LatencyHistogram(r.tpot_s * 1e6 for r in records if r.tpot_s is not None).summary_ms(),
        "itl_ms": LatencyHistogram(gap * 1e6 for r in records for gap in r.itl_s).summary_ms(),
        "e2e_ms": LatencyHistogram(r.latency_s * 1e6 for r in records).summary_ms(),
        "output_tokens": num_tokens,
        "output_tokens_per_s": _round(num_tokens / measured_s),
        "mean_output_tokens": _round(num_tokens / len(records)),
    }


def stage_breakdown(records: Sequence[RequestRecord]) -> dict[str, dict]:
    """Per stage: mean over all requests (absent counts as 0, so means stack to the mean latency),
    and percentiles over the requests that reported it."""
    if not records:
        return {}
    per_stage: dict[str, list[int]] = {}
    for r in records:
        for stage, us in r.stage_us().items():
            per_stage.setdefault(stage, []).append(us)
    out = {}
    for stage in _ordered(per_stage):
        values = per_stage[stage]
        hist = LatencyHistogram(values)
        out[stage] = {
            "mean_ms": _ms(sum(values) / len(records)),
            "p50_ms": _ms(hist.value_at_us(50)),
            "p99_ms": _ms(hist.value_at_us(99)),
            "max_ms": _ms(max(values)),
            "num_reported": len(values),
        }
    return out


def tail_attribution(records: Sequence[RequestRecord], latency: LatencyHistogram) -> dict | None:
    """For the requests above p99: which stage took the most time in each, and how often.

    "Above" means in a higher histogram bucket than p99; when none is (few requests, or the
    slowest tie at p99) the requests in p99's own bucket stand in, so there is always a tail."""
    if not records:
        return None
    p99_us = latency.value_at_us(99.0)  # the highest value equivalent to p99
    recorded_us = [round(r.latency_s * 1e6) for r in records]
    tail = [r for r, us in zip(records, recorded_us, strict=True) if us > p99_us]
    if not tail:
        floor_us = latency.lowest_equivalent_us(p99_us)
        tail = [r for r, us in zip(records, recorded_us, strict=True) if us >= floor_us]
    counts: Counter[str] = Counter()
    sums: dict[str, int] = {}
    for r in tail:
        stages = r.stage_us()
        counts[max(stages, key=stages.__getitem__)] += 1
        for stage, us in stages.items():
            sums[stage] = sums.get(stage, 0) + us
    mean_ms = {stage: _ms(sums[stage] / len(tail)) for stage in _ordered(sums)}
    top = max(counts, key=lambda s: (counts[s], sums[s]))
    return {
        "threshold_ms": _ms(p99_us),
        "num_requests": len(tail),
        "top_stage": top,
        "top_stage_share": _round(counts[top] / len(tail), 4),
        "dominant_stage_counts": {s: counts[s] for s in _ordered(counts)},
        "stage_mean_ms": mean_ms,
    }


def time_windows(records: Sequence[RequestRecord], start_s: float, measured_s: float, window_s: float) -> list[dict]:
    """Throughput by completion time and latency by scheduled time, per window of the measured period."""
    num_windows = max(1, round(measured_s / window_s))
    done_ok = [0] * num_windows
    done_err = [0] * num_windows
    scheduled = [0] * num_windows
    hists = [LatencyHistogram() for _ in range(num_windows)]
    for r in records:
        i = int((r.scheduled_s - start_s) // window_s)
        if 0 <= i < num_windows:
            scheduled[i] += 1
            if r.ok:
                hists[i].record_us(r.latency_s * 1e6)
        j = int((r.done_s - start_s) // window_s)
        if 0 <= j < num_windows:
            (done_ok if r.ok else done_err)[j] += 1
    windows = []
    for i in range(num_windows):
        summary = hists[i].summary_ms()
        windows.append({
            "start_s": _round(i * window_s),
            "num_scheduled": scheduled[i],
            "num_ok": done_ok[i],
            "num_errors": done_err[i],
            "throughput_rps": _round(done_ok[i] / window_s),
            "p50_ms": summary.get("p50"),
            "p99_ms": summary.get("p99"),
            "max_ms": summary.get("max"),
        })
    return windows


def generator_lag(lag_us: Sequence[int], lag_warn_ms: float) -> dict:
    """How late the generator itself sent requests; p99 above lag_warn_ms means results are suspect."""
    hist = LatencyHistogram(lag_us)
    summary = hist.summary_ms()
    num_late = sum(1 for us in lag_us if us > lag_warn_ms * 1000)
    p99 = summary.get("p99", 0.0)
    return {
        "lag_ms": summary,
        "lag_warn_ms": lag_warn_ms,
        "num_late": num_late,
        "fell_behind": bool(p99 > lag_warn_ms),
    }


def _ordered(stages: Iterable[str]) -> list[str]:
    known = [s for s in STAGE_ORDER if s in stages]
    return known + sorted(set(stages) - set(known))


def _first_messages(errors: Sequence[RequestRecord]) -> dict[str, str]:
    examples: dict[str, str] = {}
    for r in errors:
        examples.setdefault(r.status, r.message[:200])
    return dict(sorted(examples.items()))


def _ms(value_us: float) -> float:
    return round(value_us / 1000, 3)


def _round(value: float, digits: int = 3) -> float:
    return round(value, digits)
