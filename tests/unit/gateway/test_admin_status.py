"""The gateway's status report (a pure function of a view) and who may read it."""

from __future__ import annotations

import json

import pytest

from services.common.errors import NotFound, PermissionDenied, Unauthenticated
from services.gateway import admin_status
from services.gateway.admin_status import (
    GatewayView,
    LimitView,
    SchedulerView,
    VersionView,
    authorize,
    build_report,
)
from services.gateway.routing.circuit_breaker import BreakerState
from services.gateway.routing.pressure import PressureReport
from services.gateway.tenants.directory import (
    TenantConfigError,
    TenantDirectory,
    hash_api_key,
    parse_tenant_config,
)

ADMIN_KEY, USER_KEY = "sk-ops-0123456789", "sk-app-0123456789"


def _tenant(tenant_id: str, key: str, extra: str = "") -> str:
    return f"""
  - id: {tenant_id}
    api_key_sha256: ["{hash_api_key(key)}"]
    priority: standard
    allowed_models: ["digits", "tinylm"]
    quotas: {{requests_per_s: 10, requests_burst: 20, tokens_per_s: 100, tokens_burst: 400, max_in_flight: 5}}
{extra}"""


def directory() -> TenantDirectory:
    text = "tenants:" + _tenant("ops", ADMIN_KEY, "    admin: true") + _tenant("app", USER_KEY)
    return TenantDirectory(parse_tenant_config(text, "tenants.yaml"))


def view(**over) -> GatewayView:
    values = dict(
        uptime_s=61.0, tls="server TLS", tenants_source="tenants.yaml", tenants=directory().tenants,
        quota_store="local (this gateway's own buckets)", num_in_flight=3, max_in_flight=1024,
        schedulers=(
            SchedulerView("10.0.0.1:50052", True, BreakerState.CLOSED, ("digits",),
                          (PressureReport("digits", {}, queue_depth=4, num_workers=2, num_slots=16),)),
            SchedulerView("10.0.0.2:50052", True, BreakerState.OPEN, ("digits",), ()),
            SchedulerView("10.0.0.3:50052", True, BreakerState.CLOSED, (), ()),
            SchedulerView("10.0.0.4:50052", False, BreakerState.OPEN, (), ()),
        ),
        versions=(VersionView("digits", "1", True, 0.0, (), True), VersionView("digits", "2", False, 10.0, (), False)),
        limits=(LimitView("digits", 23.7, 3, 16),),
    )
    values.update(over)
    return GatewayView(**values)


def test_scheduler_states_name_the_worst_problem_first():
    report = build_report(view())
    assert [(r["address"], r["state"], r["queue_depth"]) for r in report.section("schedulers").records()] == [
        ("10.0.0.1:50052", "healthy", 4), ("10.0.0.2:50052", "breaker_open", 0),
        ("10.0.0.3:50052", "not_ready", 0), ("10.0.0.4:50052", "unreachable", 0)]
    assert report.section("scheduler_models").records() == [
        {"address": "10.0.0.1:50052", "model": "digits", "queue_depth": 4, "num_workers": 2, "kv_usage": 0.0,
         "num_slots": 16}]


def test_routing_tenants_and_limits_in_force():
    report = build_report(view()).to_dict()
    assert report["models"][1] == {"model": "digits", "version": "2", "default": False, "canary_percent": 10.0,
                                   "endpoints": "discovered", "ready": False}
    assert report["tenants"][0] == {
        "id": "ops", "priority": "standard", "weight": 1, "allowed_models": "digits,tinylm", "requests_per_s": 10.0,
        "requests_burst": 20, "tokens_per_s": 100.0, "tokens_burst": 400, "max_in_flight": 5, "admin": True}
    assert report["limits"] == [{"model": "digits", "limit": 23.7, "num_in_flight": 3, "num_slots": 16}]
    assert (report["tls"], report["tenants_file"], report["num_in_flight"]) == ("server TLS", "tenants.yaml", 3)


def test_status_never_carries_keys_or_their_digests():
    text = json.dumps(build_report(view()).to_dict())
    for secret in (ADMIN_KEY, USER_KEY, hash_api_key(ADMIN_KEY), hash_api_key(USER_KEY)):
        assert secret not in text
    assert "sha256" not in text


def test_anonymous_mode_says_so():
    report = build_report(view(tenants_source="", tenants=())).to_dict()
    assert report["tenants_file"].startswith("none (anonymous mode")
    assert report["tenants"] == []


def test_only_an_admin_tenant_may_read_the_status():
    authorize(directory(), f"Bearer {ADMIN_KEY}", "ipv4:10.1.2.3:4000")
    with pytest.raises(PermissionDenied, match="tenant 'app' may not use the gateway's Admin service.*admin: true"):
        authorize(directory(), f"Bearer {USER_KEY}", "ipv4:127.0.0.1:4000")
    with pytest.raises(Unauthenticated, match="missing API key"):
        authorize(directory(), None, "ipv4:127.0.0.1:4000")
    with pytest.raises(Unauthenticated, match="invalid API key"):
        authorize(directory(), "Bearer sk-nobody", "ipv4:127.0.0.1:4000")


def test_anonymous_gateway_answers_loopback_callers_only():
    authorize(None, None, "ipv4:127.0.0.1:4000")
    with pytest.raises(PermissionDenied, match="without a tenants file"):
        authorize(None, None, "ipv4:10.1.2.3:4000")


@pytest.mark.parametrize("value", ['"true"', "1", "null"])
def test_admin_flag_must_be_a_plain_boolean(value):
    text = "tenants:" + _tenant("ops", ADMIN_KEY, f"    admin: {value}")
    with pytest.raises(TenantConfigError, match="tenant 'ops': field 'admin': must be true or false"):
        parse_tenant_config(text, "tenants.yaml")


def test_tenants_are_not_admins_unless_flagged():
    assert [t.admin for t in directory().tenants] == [True, False]


def test_control_rollout_without_a_routing_file_is_not_found():
    with pytest.raises(NotFound, match="'digits' has no rollout: this gateway runs without a routing file"):
        admin_status.control_rollout(None, "digits", "pause", "by hand")
