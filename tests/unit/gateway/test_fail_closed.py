"""Fail closed: a gateway without a tenants file starts only when --allow-anonymous asks for it."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.gateway.config import GatewayConfig


def test_no_tenants_file_refuses_with_one_line_naming_both_flags():
    with pytest.raises(ConfigError) as caught:
        load_config(GatewayConfig, "gateway", [], {})
    message = str(caught.value)
    assert "--tenants-file" in message and "--allow-anonymous" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--allow-anonymous"], {}),
        (["--allow-anonymous", "true"], {}),
        ([], {"INFERMESH_GATEWAY_ALLOW_ANONYMOUS": "true"}),
    ],
)
def test_allow_anonymous_as_a_bare_flag_a_value_or_the_environment(argv, env):
    assert load_config(GatewayConfig, "gateway", argv, env).allow_anonymous


def test_allow_anonymous_false_still_refuses():
    with pytest.raises(ConfigError, match="no tenants file"):
        load_config(GatewayConfig, "gateway", ["--allow-anonymous", "false"], {})


def test_a_tenants_file_needs_no_flag():
    config = load_config(GatewayConfig, "gateway", ["--tenants-file", "tenants.yaml"], {})
    assert not config.allow_anonymous


def test_a_bare_bool_flag_before_another_flag_keeps_both():
    config = load_config(GatewayConfig, "gateway", ["--allow-anonymous", "--port", "7000"], {})
    assert (config.allow_anonymous, config.port) == (True, 7000)
