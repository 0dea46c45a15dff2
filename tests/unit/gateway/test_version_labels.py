"""The `version` on the gateway's request metrics: the version that served, bounded to the ones the
gateway knows; and the per-stage histogram fed from a served reply's timings."""

from __future__ import annotations

from prometheus_client import REGISTRY

from infermesh.v1 import common_pb2
from services.common.metric_labels import OTHER, KnownVersions
from services.gateway.admission.admission import RequestScope
from services.gateway.admission.concurrency import ConcurrencyLimiter
from services.gateway.telemetry import metrics

KNOWN = {("tinylm", "1"), ("tinylm", "2")}


def _label() -> KnownVersions:
    return KnownVersions(lambda model, version: (model, version) in KNOWN, none=metrics.NO_VERSION)


def _count(model: str, version: str, code: str) -> float:
    return REGISTRY.get_sample_value("infermesh_gateway_requests_total", {
        "tenant": "unauthenticated", "model": model, "version": version, "method": "Generate", "code": code}) or 0.0


def test_known_versions_keep_their_label_and_the_rest_share_other():
    label = _label()
    assert [label("tinylm", "2"), label("tinylm", "9"), label("tinylm", ""), label(OTHER, "1")] == [
        "2", OTHER, metrics.NO_VERSION, OTHER]
    KNOWN.discard(("tinylm", "2"))
    try:
        assert label("tinylm", "2") == "2", "a version once known keeps its series while its last calls finish"
    finally:
        KNOWN.add(("tinylm", "2"))


def test_request_is_counted_under_the_version_that_served_it(clock):
    before = {v: _count("tinylm", v, "OK") for v in ("1", "2", metrics.NO_VERSION)}
    for routed, replied in (("2", "2"), ("1", ""), ("", "")):
        scope = RequestScope("Generate", "tinylm", "", clock, ConcurrencyLimiter(4), version_label=_label())
        scope.served_by(routed)  # what dispatch's route chose ("" when the scheduler picks)
        scope.served_by(replied)  # what the reply said ("" on chunks that do not say)
        scope.finish("OK")
    after = {v: _count("tinylm", v, "OK") for v in ("1", "2", metrics.NO_VERSION)}
    assert {v: after[v] - before[v] for v in after} == {"1": 1, "2": 1, metrics.NO_VERSION: 1}


def test_a_served_replys_stages_feed_the_stage_histogram(clock):
    def stage_count(stage: str, service: str) -> float:
        return REGISTRY.get_sample_value("infermesh_gateway_stage_duration_seconds_count", {
            "model": "tinylm", "version": "1", "service": service, "stage": stage}) or 0.0

    before = stage_count("queue_wait", "scheduler"), stage_count("compute", "worker")
    scope = RequestScope("Classify", "tinylm", "1", clock, ConcurrencyLimiter(4), version_label=_label())
    scope.timings = common_pb2.Timings(stages=[
        common_pb2.StageTiming(stage=common_pb2.STAGE_QUEUE_WAIT, duration_us=1500, service="scheduler"),
        common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=4000, service="worker"),
        common_pb2.StageTiming(stage=common_pb2.STAGE_COMPUTE, duration_us=1, service="made-up"),  # dropped
    ])
    scope.finish("OK")
    assert (stage_count("queue_wait", "scheduler") - before[0], stage_count("compute", "worker") - before[1]) == (1, 1)
    assert REGISTRY.get_sample_value("infermesh_gateway_stage_duration_seconds_count", {
        "model": "tinylm", "version": "1", "service": "made-up", "stage": "compute"}) is None
