"""The gateway's --quota-store-* settings: defaults keep per-gateway quotas, bad values are named."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.gateway.config import GatewayConfig


def test_no_store_by_default_and_the_lease_config_in_seconds():
    config = load_config(GatewayConfig, "gateway", ["--allow-anonymous"], {})
    assert config.quota_store_address == ""  # per-gateway quotas, as before the store
    assert config.quota_store_prefix == "infermesh:quota:"
    flags = ["--allow-anonymous", "--quota-store-address", "valkey:6379", "--quota-lease-interval-ms", "250",
             "--quota-expected-gateways", "3", "--quota-store-ttl-ms", "2000", "--gateway-id", "gw-a"]
    config = load_config(GatewayConfig, "gateway", flags, {})
    lease = config.lease_config()
    assert (lease.interval_s, lease.expected_gateways) == (0.25, 3)
    assert (config.quota_store_address, config.gateway_id) == ("valkey:6379", "gw-a")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"INFERMESH_GATEWAY_QUOTA_STORE_ADDRESS": "valkey"}, "quota_store_address must be host:port, got 'valkey'"),
        ({"INFERMESH_GATEWAY_QUOTA_STORE_TTL_MS": "150"},
         "quota_store_ttl_ms (150.0) must be >= 2 x quota_lease_interval_ms (100.0)"),
        ({"INFERMESH_GATEWAY_QUOTA_EXPECTED_GATEWAYS": "0"}, "expected_gateways must be >= 1, got 0"),
        ({"INFERMESH_GATEWAY_QUOTA_LEASE_INTERVAL_MS": "0", "INFERMESH_GATEWAY_QUOTA_STORE_TTL_MS": "10"},
         "lease interval_s must be > 0, got 0.0"),
    ],
)
def test_bad_quota_store_settings_fail_with_a_message_naming_them(env, message):
    with pytest.raises(ConfigError) as caught:
        load_config(GatewayConfig, "gateway", [], env)
    assert str(caught.value).startswith(message)
