"""The scheduler's status report, a pure function of its models' views."""

from __future__ import annotations

from services.scheduler.admin_status import ModelView, WorkerView, build_report


def test_models_and_workers_in_force():
    models = [
        ModelView("tinylm", "1", "generator", queue_depth=5, num_slots=48, workers=(
            WorkerView("w2", "draining", 1, 3, 32, 40, 256), WorkerView("w1", "ready", 1, 7, 32, 100, 256))),
        ModelView("digits", "1", "classifier", queue_depth=2, num_slots=16, workers=(
            WorkerView("c1", "ready", 2, 0, 8, 0, 0),)),
    ]
    report = build_report(models, uptime_s=3.0, draining=True, tls="mTLS").to_dict()
    assert (report["service"], report["draining"], report["tls"]) == ("scheduler", True, "mTLS")
    assert report["models"] == [
        {"model": "digits", "version": "1", "kind": "classifier", "num_workers": 1, "queue_depth": 2,
         "num_slots": 16, "kv_blocks_used": 0, "kv_blocks_total": 0},
        {"model": "tinylm", "version": "1", "kind": "generator", "num_workers": 1, "queue_depth": 5,
         "num_slots": 48, "kv_blocks_used": 140, "kv_blocks_total": 512},
    ]
    assert [(w["worker_id"], w["model"], w["state"], w["num_sequences"]) for w in report["workers"]] == [
        ("c1", "digits", "ready", 0), ("w1", "tinylm", "ready", 7), ("w2", "tinylm", "draining", 3)]


def test_a_scheduler_without_workers_reports_empty_tables():
    report = build_report([], uptime_s=0.5, draining=False, tls="off").to_dict()
    assert (report["models"], report["workers"]) == ([], [])
