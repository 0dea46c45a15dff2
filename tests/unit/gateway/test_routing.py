from __future__ import annotations

import collections
import random

import pytest
import yaml

from services.common.errors import NotFound, Unavailable
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.table import (
    RoutingConfigError,
    RoutingTable,
    load_routing_file,
    parse_routing_config,
)

from .conftest import FixedRng

CONFIG = yaml.safe_load(
    """
models:
  digits:
    default_version: "1"
    endpoints: ["a:1", "b:1"]
  tinylm:
    default_version: "1"
    endpoints:
      - {address: "a:1", weight: 3}
      - {address: "b:1", weight: 1}
    versions:
      "2": {canary_percent: 10, endpoints: ["c:1"]}
"""
)


def make_table(clock, rng) -> tuple[RoutingTable, CircuitBreakers]:
    breakers = CircuitBreakers(BreakerConfig(num_consecutive_failures_to_open=1, open_cooldown_s=5.0), clock)
    return RoutingTable(parse_routing_config(CONFIG, "routes.yaml"), breakers, rng=rng), breakers


def trip(breakers: CircuitBreakers, endpoint: str) -> None:
    breakers.for_endpoint(endpoint).try_acquire().failure()


def test_parses_shared_and_per_version_endpoints():
    routes = {r.model: r for r in parse_routing_config(CONFIG, "routes.yaml")}
    tinylm = routes["tinylm"]
    assert tinylm.default_version == "1"
    assert [e.address for e in tinylm.version("1").endpoints] == ["a:1", "b:1"]
    assert [e.weight for e in tinylm.version("1").endpoints] == [3.0, 1.0]
    assert tinylm.version("2").canary_percent == 10.0
    assert [e.address for e in tinylm.version("2").endpoints] == ["c:1"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"endpoints": ["a:1"]}, "routes.yaml: model 'm': field 'default_version': is required"),
        (
            {"default_version": "1", "endpoints": ["nohost"]},
            "routes.yaml: model 'm': field 'endpoints[0]': address must be 'host:port'",
        ),
        (
            {
                "default_version": "1",
                "endpoints": ["a:1"],
                "versions": {"2": {"canary_percent": 60}, "3": {"canary_percent": 50}},
            },
            "routes.yaml: model 'm': field 'versions': canary_percent values add up to 110, more than 100",
        ),
        (
            {"default_version": "1", "endpoints": ["a:1"], "versions": {"1": {"canary_percent": 5}}},
            "routes.yaml: model 'm': field 'versions.1.canary_percent': not allowed on the default version",
        ),
    ],
)
def test_rejects_bad_routes_naming_model_and_field(spec, message):
    with pytest.raises(RoutingConfigError) as info:
        parse_routing_config({"models": {"m": spec}}, "routes.yaml")
    assert str(info.value).startswith(message)


def test_unknown_model_or_version_is_not_found(clock):
    table, _ = make_table(clock, FixedRng(0.5))
    with pytest.raises(NotFound) as info:
        table.choose("resnet")
    assert info.value.message == "unknown model 'resnet'"
    with pytest.raises(NotFound) as info:
        table.choose("digits", "7")
    assert info.value.message == "unknown version '7' of model 'digits'"


def test_splits_versionless_traffic_by_canary_percent(clock):
    table, _ = make_table(clock, random.Random(7).random)
    versions = collections.Counter(table.choose("tinylm").version for _ in range(5000))
    assert 400 <= versions["2"] <= 600  # 10% of 5000
    assert table.choose("tinylm", "2").endpoint == "c:1"


def test_spreads_over_endpoints_by_weight(clock):
    table, _ = make_table(clock, random.Random(3).random)
    endpoints = collections.Counter(table.choose("tinylm", "1").endpoint for _ in range(4000))
    assert 2800 <= endpoints["a:1"] <= 3200  # weight 3 of 4


def test_skips_endpoints_whose_breaker_is_open(clock):
    table, breakers = make_table(clock, random.Random(1).random)
    trip(breakers, "a:1")
    assert {table.choose("digits").endpoint for _ in range(50)} == {"b:1"}


def test_retry_prefers_an_endpoint_not_yet_tried_but_falls_back(clock):
    table, breakers = make_table(clock, FixedRng(0.0))
    assert table.choose("digits", exclude=frozenset({"a:1"})).endpoint == "b:1"
    trip(breakers, "b:1")
    assert table.choose("digits", exclude=frozenset({"a:1"})).endpoint == "a:1"


def test_broken_canary_falls_back_to_default_version(clock):
    table, breakers = make_table(clock, FixedRng(0.05))  # would draw the canary
    trip(breakers, "c:1")
    route = table.choose("tinylm")
    assert (route.version, route.endpoint) == ("1", "a:1")
    with pytest.raises(Unavailable):
        table.choose("tinylm", "2")  # asked for explicitly: no fallback


def test_all_breakers_open_is_unavailable_with_time_to_first_probe(clock):
    table, breakers = make_table(clock, FixedRng(0.5))
    trip(breakers, "a:1")
    clock.advance(2.0)
    trip(breakers, "b:1")
    with pytest.raises(Unavailable) as info:
        table.choose("digits")
    assert (
        info.value.message
        == "no scheduler available for model 'digits' version '1': circuit open for all 2 endpoints"
    )
    assert info.value.retry_after_s == pytest.approx(3.0)


def test_route_permit_reports_to_the_chosen_endpoints_breaker(clock):
    table, breakers = make_table(clock, FixedRng(0.0))
    route = table.choose("digits")
    route.permit.failure()
    assert not breakers.for_endpoint(route.endpoint).is_available()
    assert table.endpoints() == ("a:1", "b:1", "c:1")


def test_a_routing_file_that_is_not_utf8_is_a_config_error(tmp_path):
    # Found by atheris (fuzz/routing.py): UnicodeDecodeError escaped the file watcher's refusal.
    path = tmp_path / "routing.yaml"
    path.write_bytes(b"models:\n  digits: {default_version: '1'}  # caf\xe9\n")
    with pytest.raises(RoutingConfigError, match="not UTF-8"):
        load_routing_file(path)
