"""metrics.observe_many: the same exposition as observe() called once per observation."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from services.scheduler import metrics

_BUCKETS = (0.001, 0.005, 0.01, 0.1)


def _pair() -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    one_by_one, bulk = CollectorRegistry(), CollectorRegistry()
    return (one_by_one, Histogram("h_seconds", "h", ["model"], buckets=_BUCKETS, registry=one_by_one),
            bulk, Histogram("h_seconds", "h", ["model"], buckets=_BUCKETS, registry=bulk))


def _samples(registry: CollectorRegistry) -> dict[str, float]:
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for metric in registry.collect() for s in metric.samples if not s.name.endswith("_created")}


@pytest.mark.parametrize("amount", [0.0, 0.0005, 0.001, 0.003, 0.005, 0.05, 0.1, 7.0])
@pytest.mark.parametrize("count", [1, 2, 64])
def test_bulk_matches_one_by_one_on_and_between_bucket_bounds(amount: float, count: int) -> None:
    reg_a, hist_a, reg_b, hist_b = _pair()
    for _ in range(count):
        hist_a.labels("m").observe(amount)
    metrics.observe_many(hist_b.labels("m"), amount, count)
    a, b = _samples(reg_a), _samples(reg_b)
    assert a.keys() == b.keys()
    for name in a:
        assert b[name] == pytest.approx(a[name]), name


def test_zero_count_records_nothing() -> None:
    _, _, reg_b, hist_b = _pair()
    child = hist_b.labels("m")
    metrics.observe_many(child, 0.003, 0)
    assert b"h_seconds_count{model=\"m\"} 0.0" in generate_latest(reg_b)


def test_mixed_amounts_accumulate() -> None:
    reg_a, hist_a, reg_b, hist_b = _pair()
    for amount, count in ((0.002, 5), (0.2, 3), (0.002, 4)):
        for _ in range(count):
            hist_a.labels("m").observe(amount)
        metrics.observe_many(hist_b.labels("m"), amount, count)
    assert _samples(reg_a) == pytest.approx(_samples(reg_b))
