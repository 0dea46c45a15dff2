"""Admin/GetStatus plumbing: the loopback rule, the TLS mode, and the proto codec both ways."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.common import admin
from services.common.admin_servicer import from_proto, to_proto
from services.common.errors import PermissionDenied


@pytest.mark.parametrize("peer", ["ipv4:127.0.0.1:5000", "ipv4:127.0.0.9:1", "ipv6:%5B::1%5D:5000",
                                  "ipv6:[::1]:5000", "unix:/tmp/socket"])
def test_loopback_callers_are_recognised(peer):
    assert admin.is_loopback(peer)


@pytest.mark.parametrize("peer", ["ipv4:10.0.0.7:5000", "ipv6:%5B2001:db8::1%5D:5000", "", "garbage",
                                  "ipv4:localhost:1"])
def test_other_callers_are_not_loopback(peer):
    assert not admin.is_loopback(peer)


def test_without_a_certificate_only_loopback_may_read_status():
    admin.certificate_or_loopback("ipv4:127.0.0.1:5000", (), has_cert=False)
    admin.certificate_or_loopback("ipv4:10.0.0.7:5000", (), has_cert=True)  # the identity policy let it in
    with pytest.raises(PermissionDenied, match="10.0.0.7 refused.*--tls-allowed-admin-ids.*loopback"):
        admin.certificate_or_loopback("ipv4:10.0.0.7:5000", (), has_cert=False)


@dataclass
class _Settings:
    tls_cert_file: str = "cert.pem"
    tls_client_auth: str = "auto"
    tls_identity_check: bool = True


def test_tls_mode_follows_the_listener_settings():
    assert admin.tls_mode(_Settings(tls_cert_file=""), client_certs_by_default=True) == "off"
    assert admin.tls_mode(_Settings(), client_certs_by_default=False) == "server TLS"
    assert admin.tls_mode(_Settings(), client_certs_by_default=True) == "mTLS"
    assert admin.tls_mode(_Settings(tls_client_auth="require"), client_certs_by_default=False) == "mTLS"
    assert admin.tls_mode(_Settings(tls_client_auth="none"), client_certs_by_default=True) == "server TLS"
    assert "no per-method identity check" in admin.tls_mode(_Settings(tls_identity_check=False), True)


def test_a_row_must_match_its_columns():
    with pytest.raises(ValueError, match="section workers: a row has 1 cells for 2 columns"):
        admin.section("workers", ("id", "state"), [("w1",)])


def test_report_survives_the_wire_with_its_types():
    report = admin.StatusReport(
        service="scheduler", version="0.1.0", uptime_s=12.5,
        facts=admin.facts({"tls": "mTLS", "draining": False, "num": 3, "ratio": 0.25, "empty": ""}),
        sections=(admin.section("workers", ("id", "slots", "usage", "ready"), [("w1", 8, 0.5, True)]),
                  admin.section("models", ("model",), [])),
    )
    back = from_proto(to_proto(report))
    assert back == report
    assert back.to_dict() == {
        "service": "scheduler", "version": "0.1.0", "uptime_s": 12.5, "tls": "mTLS", "draining": False,
        "num": 3, "ratio": 0.25, "empty": "",
        "workers": [{"id": "w1", "slots": 8, "usage": 0.5, "ready": True}], "models": [],
    }


def test_a_reply_with_a_ragged_row_is_refused():
    message = to_proto(admin.StatusReport("worker", "0.1.0", 1.0, sections=(admin.section("s", ("a", "b"), [(1, 2)]),)))
    del message.sections[0].rows[0].cells[1]
    with pytest.raises(ValueError, match="a row has 1 cells for 2 columns"):
        from_proto(message)


def test_every_service_lists_admin_for_health_and_reflection():
    from services.gateway.server import GatewayService
    from services.scheduler.server import SchedulerService
    from services.worker.server import WorkerService

    for service in (GatewayService, SchedulerService, WorkerService):
        assert "infermesh.v1.Admin" in service.service_names, service.__name__
