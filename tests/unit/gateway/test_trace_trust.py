"""Untrusted trace context at the edge: a client's traceparent is linked, not followed, unless trusted."""

from __future__ import annotations

import pytest
import yaml
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

from services.common import telemetry
from services.common.errors import Unauthenticated
from services.common.telemetry import server_span
from services.gateway.admission.trace_trust import TraceTrust, TrustMode
from services.gateway.tenants.directory import TenantDirectory, parse_tenant_config
from tools.testbed.gateway_fixtures import tenant

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SAMPLED = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"),)
NOT_SAMPLED = (("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"),)
TENANTS = yaml.safe_dump({"tenants": [{**tenant("proxy", "proxy-key"), "trust_trace_context": True},
                                       tenant("shop", "shop-key")]})


def run_request(trust: TraceTrust, metadata, authorization=None, root_sampler=ALWAYS_ON):
    """One edge span as the gateway opens it; the finished spans."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(root=root_sampler))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent, links = trust.parent(metadata, authorization)
    with server_span(provider.get_tracer("test"), "infermesh.v1.Inference/Classify", parent, links):
        pass
    return exporter.get_finished_spans()


def directory() -> TenantDirectory:
    return TenantDirectory(parse_tenant_config(TENANTS, "tenants.yaml"))


def test_an_untrusted_traceparent_becomes_a_link_under_a_fresh_trace():
    (edge,) = run_request(TraceTrust(), SAMPLED)
    assert format(edge.context.trace_id, "032x") != CLIENT_TRACE
    assert edge.parent is None
    (link,) = edge.links
    assert (format(link.context.trace_id, "032x"), format(link.context.span_id, "016x")) == (CLIENT_TRACE, CLIENT_SPAN)
    assert link.attributes["infermesh.trace_context"] == "untrusted"


def test_an_untrusted_client_cannot_force_sampling():
    assert run_request(TraceTrust(), SAMPLED, root_sampler=ALWAYS_OFF) == ()


def test_an_untrusted_client_cannot_switch_sampling_off():
    (edge,) = run_request(TraceTrust(), NOT_SAMPLED)
    assert edge.context.trace_flags.sampled


def test_trust_all_follows_the_caller_and_its_sampling_decision():
    (edge,) = run_request(TraceTrust(TrustMode.ALL), SAMPLED, root_sampler=ALWAYS_OFF)
    assert format(edge.context.trace_id, "032x") == CLIENT_TRACE
    assert format(edge.parent.span_id, "016x") == CLIENT_SPAN
    assert edge.links == ()
    assert run_request(TraceTrust(TrustMode.ALL), NOT_SAMPLED) == ()


@pytest.mark.parametrize(("authorization", "followed"),
                         [("Bearer proxy-key", True), ("Bearer shop-key", False), ("Bearer made-up", False), (None, False)])
def test_trust_tenants_follows_only_tenants_marked_in_the_tenants_file(authorization, followed):
    (edge,) = run_request(TraceTrust(TrustMode.TENANTS, directory()), SAMPLED, authorization)
    assert (format(edge.context.trace_id, "032x") == CLIENT_TRACE) is followed
    assert len(edge.links) == (0 if followed else 1)


def test_no_traceparent_starts_a_root_without_links():
    (edge,) = run_request(TraceTrust(TrustMode.ALL), ())
    assert edge.parent is None and edge.links == ()


def test_garbage_traceparent_is_neither_followed_nor_linked():
    (edge,) = run_request(TraceTrust(), (("traceparent", "00-zz-yy-01"),))
    assert edge.parent is None and edge.links == ()


def test_without_recording_the_edge_still_mints_its_own_unsampled_trace_id(monkeypatch):
    monkeypatch.setattr(telemetry, "_recording", False)
    parent, links = TraceTrust().parent(SAMPLED, None)
    minted = trace.get_current_span(parent).get_span_context()
    assert minted.is_valid and not minted.trace_flags.sampled
    assert format(minted.trace_id, "032x") != CLIENT_TRACE
    assert links != ()  # built, though nothing records them


def test_trusted_tenant_flag_is_read_from_the_tenants_file():
    tenants = directory()
    assert tenants.authenticate("Bearer proxy-key").trust_trace_context
    assert not tenants.authenticate("Bearer shop-key").trust_trace_context
    with pytest.raises(Unauthenticated):
        tenants.authenticate("Bearer nobody")


def test_tenants_mode_needs_tenants():
    with pytest.raises(ValueError, match="needs the tenants"):
        TraceTrust(TrustMode.TENANTS)
