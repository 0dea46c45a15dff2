"""The worker's status report, and its figures read from the worker's own counters."""

from __future__ import annotations

from services.worker import metrics
from services.worker.admin_status import ServedView, WorkerView, build_report, served


def test_worker_report_facts_and_served_rows():
    view = WorkerView("w1", "tinylm", "2", "ready", "cpu", 4, "cgroup", "dns:///scheduler:50052", 1.23456,
                      (ServedView("step", 10, 40, 1, 0, 40),))
    report = build_report(view, uptime_s=9.0, tls="mTLS").to_dict()
    assert {k: report[k] for k in ("model", "version_served", "state", "device", "threads", "model_load_s")} == {
        "model": "tinylm", "version_served": "2", "state": "ready", "device": "cpu", "threads": 4,
        "model_load_s": 1.235}
    assert report["served"] == [{"kind": "step", "num_batches": 10, "num_items_ok": 40, "num_items_failed": 1,
                                 "num_items_expired": 0, "num_tokens": 40}]


def test_served_figures_equal_the_metrics():
    model = "admin-status-test-model"
    metrics.ITEMS.labels(model, "classify", "ok").inc(5)
    metrics.ITEMS.labels(model, "classify", "expired").inc(2)
    metrics.BATCH_SIZE.labels(model, "classify").observe(5)
    assert served(model, generator=False) == (ServedView("classify", 1, 5, 0, 2, 0),)
    metrics.GENERATED_TOKENS.labels(model).inc(7)
    assert served(model, generator=True) == (ServedView("step", 0, 0, 0, 0, 7),)
