"""--quota-store-address: one store (host:port) or Valkey Sentinel (sentinel://host:port[,...]/name)."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.gateway.config import GatewayConfig
from services.gateway.quota.store_address import StoreAddress, parse_store_address


def test_one_store_and_sentinels_with_the_primary_name():
    assert parse_store_address("valkey:6379") == StoreAddress(direct=("valkey", 6379))
    assert parse_store_address("[fd00::1]:6379") == StoreAddress(direct=("fd00::1", 6379))
    assert parse_store_address("sentinel://s1:26379,s2:26379/quota") == StoreAddress(
        direct=None, sentinels=(("s1", 26379), ("s2", 26379)), primary_name="quota")


@pytest.mark.parametrize("address", ["valkey", "valkey:port", "sentinel://s1:26379", "sentinel://s1:26379/",
                                     "sentinel://s1/quota", "sentinel://s1:26379/a/b", ":6379", "h:0"])
def test_a_bad_address_is_refused_at_start_naming_the_form(address):
    with pytest.raises(ConfigError, match="host:port"):
        GatewayConfig(allow_anonymous=True, quota_store_address=address)
