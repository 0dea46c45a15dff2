"""What each listener does about TLS, from the settings (tls.plan and the --tls-* settings)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, ServerSettings, load_config
from services.common.tls import plan
from services.scheduler.config import SchedulerConfig

FILES = {"tls_cert_file": "s.pem", "tls_key_file": "s-key.pem", "tls_ca_file": "ca.pem"}


def test_plaintext_without_a_certificate():
    tls = plan(ServerSettings(), "scheduler")
    assert not tls.enabled and tls.identity_policy is None


def test_scheduler_and_worker_require_client_certificates_and_check_identities_by_default():
    for service in ("scheduler", "worker"):
        tls = plan(ServerSettings(**FILES), service)
        assert tls.enabled and tls.require_client_cert
        assert tls.identity_policy.gateway_ids == ("spiffe://infermesh/gateway",)


def test_the_gateway_asks_no_client_certificate_by_default():
    tls = plan(ServerSettings(**FILES), "gateway")
    assert tls.enabled and not tls.require_client_cert and tls.identity_policy is None


def test_identity_check_can_be_switched_off_for_a_service_mesh():
    config = load_config(SchedulerConfig, "scheduler", ["--tls-identity-check", "off", "--tls-cert-file", "s.pem",
                                                        "--tls-key-file", "k.pem", "--tls-ca-file", "ca.pem"], {})
    tls = plan(config, "scheduler")
    assert tls.require_client_cert and tls.identity_policy is None


def test_allowed_ids_come_from_flags():
    config = load_config(SchedulerConfig, "scheduler", [
        "--tls-cert-file", "s.pem", "--tls-key-file", "k.pem", "--tls-ca-file", "ca.pem",
        "--tls-allowed-gateway-ids", "spiffe://prod/gateway,gateway.prod.svc"], {})
    assert plan(config, "scheduler").identity_policy.gateway_ids == ("spiffe://prod/gateway", "gateway.prod.svc")


def test_requiring_client_certificates_without_a_ca_is_a_configuration_error():
    settings = ServerSettings(tls_cert_file="s.pem", tls_key_file="s-key.pem")
    with pytest.raises(ConfigError, match="scheduler requires client certificates .* but --tls-ca-file is empty"):
        plan(settings, "scheduler")


@pytest.mark.parametrize(("values", "message"), [
    ({"tls_cert_file": "s.pem"}, "tls_cert_file and tls_key_file go together"),
    ({**FILES, "tls_client_auth": "maybe"}, "tls_client_auth must be auto, require, optional or none, got 'maybe'"),
    ({"tls_ca_file": "ca.pem"}, "tls_ca_file is set but tls_cert_file is not"),
])
def test_inconsistent_tls_settings_fail_at_start(values, message):
    with pytest.raises(ConfigError, match=message):
        ServerSettings(**values)
