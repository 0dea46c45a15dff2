"""Development routing: without a routing config every model goes to one scheduler."""

from __future__ import annotations

import pytest

from services.common.errors import NotFound
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.table import RoutingTable, parse_routing_config


def test_fallback_sends_any_model_there_with_the_version_the_client_named(clock):
    table = RoutingTable((), CircuitBreakers(BreakerConfig(), clock), fallback_endpoint="127.0.0.1:50052")
    assert table.endpoints() == ("127.0.0.1:50052",)
    named = table.choose("anything", "7")
    assert (named.model, named.version, named.endpoint) == ("anything", "7", "127.0.0.1:50052")
    assert table.choose("anything").version == "", "the scheduler serves its only attached version"
    assert table.model("anything").default_version == ""


def test_a_configured_table_knows_only_its_models(clock):
    routes = parse_routing_config({"models": {"digits": {"default_version": "1", "endpoints": ["a:1"]}}}, "r.yaml")
    table = RoutingTable(routes, CircuitBreakers(BreakerConfig(), clock))
    assert table.choose("digits").endpoint == "a:1"
    with pytest.raises(NotFound, match="unknown model 'tinylm'"):
        table.choose("tinylm")
