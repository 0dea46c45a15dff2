"""The gateway's start-up reading of its files: every bad file is a ConfigError (exit 2 with the reason)."""

from __future__ import annotations

import time

import pytest

from services.common.config import ConfigError, load_config
from services.gateway.config import GatewayConfig
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.server import load_routing


def test_a_routing_file_that_is_not_utf8_stops_the_start_with_a_config_error(tmp_path):
    # Found by atheris (fuzz/routing.py): the start-up read let UnicodeDecodeError out as a traceback.
    path = tmp_path / "routing.yaml"
    path.write_bytes(b"models:\n  digits: {default_version: '1'}  # caf\xe9\n")
    breakers = CircuitBreakers(BreakerConfig(), time.monotonic)
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_routing(GatewayConfig(routing_file=str(path), allow_anonymous=True), breakers, None)


@pytest.mark.parametrize("origin", ["chat.example.com", "https://chat.example.com/", "https://chat.example.com/app"])
def test_a_cors_origin_that_is_not_an_origin_is_a_config_error(origin):
    with pytest.raises(ConfigError, match=r"http_cors_origins: each is \* or scheme://host\[:port\] with no path"):
        GatewayConfig(http_cors_origins=(origin,), allow_anonymous=True)
    GatewayConfig(http_cors_origins=("*", "http://localhost:3000"), allow_anonymous=True)


def test_responses_are_not_stored_unless_a_bound_is_given_by_flag_or_env():
    assert load_config(GatewayConfig, "gateway", ["--allow-anonymous"], {}).responses_store_bytes == 0
    flags = ["--allow-anonymous", "--responses-store-bytes", "1000000", "--responses-store-ttl-s", "60"]
    config = load_config(GatewayConfig, "gateway", flags, {})
    assert (config.responses_store_bytes, config.responses_store_ttl_s) == (1_000_000, 60.0)
    env = {"INFERMESH_GATEWAY_RESPONSES_STORE_BYTES": "5000", "INFERMESH_GATEWAY_ALLOW_ANONYMOUS": "true"}
    assert load_config(GatewayConfig, "gateway", [], env).responses_store_bytes == 5000


@pytest.mark.parametrize(("flags", "message"), [
    (["--responses-store-bytes", "-1"], "responses_store_bytes"),
    (["--responses-store-ttl-s", "0"], "responses_store_ttl_s must be > 0, got 0.0"),
])
def test_bad_responses_store_settings_are_config_errors_naming_them(flags, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GatewayConfig, "gateway", ["--allow-anonymous", *flags], {})
