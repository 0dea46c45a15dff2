"""The routing file: reloaded on change (a bad file keeps the old routes), versions on discovered
schedulers (the Kubernetes canary), and what metric labels may know of versions."""

from __future__ import annotations

import logging
import os

import pytest

from services.common.errors import NotFound
from services.common.file_watch import WatchedFile
from services.gateway.routing.circuit_breaker import BreakerConfig, CircuitBreakers
from services.gateway.routing.replicas import Membership, ReplicaSelector
from services.gateway.routing.table import (
    RoutingConfigError,
    RoutingTable,
    describe_routes,
    load_routing_file,
    parse_routing_config,
)

from .conftest import FixedRng

A, B = "10.0.0.1:50052", "10.0.0.2:50052"
BASELINE = """
models:
  tinylm:
    default_version: "1"
  digits:
    default_version: "1"
"""
CANARY_10 = BASELINE.replace('default_version: "1"\n  digits', 'default_version: "1"\n    versions:\n'
                             '      "2": {canary_percent: 10}\n  digits')


def write(path, text: str, mtime_ns: int) -> None:
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(mtime_ns, mtime_ns))


def discovered_table(clock, routes, rng=None, serving=None):
    membership = Membership(lambda: (A, B))
    breakers = CircuitBreakers(BreakerConfig(), clock)
    table = RoutingTable(routes, breakers, rng=rng or FixedRng(0.5), replicas=ReplicaSelector(membership),
                         serving=serving)
    return table, membership


def watch(path, table: RoutingTable) -> WatchedFile:
    return WatchedFile(path, load_routing_file, what="routing file", error=RoutingConfigError,
                       describe=describe_routes, on_reload=table.replace)


def test_canary_percent_edit_is_picked_up_on_the_next_poll(tmp_path, clock):
    path = tmp_path / "routing.yaml"
    write(path, BASELINE, 1_000_000_000)
    table, _ = discovered_table(clock, load_routing_file(path), rng=FixedRng(0.05))
    watcher = watch(path, table)
    assert watcher.poll() is None
    assert table.choose("tinylm").version == "1"

    write(path, CANARY_10, 2_000_000_000)
    result = watcher.poll()

    assert result.applied and result.reason == f"{path}: loaded tinylm 1 (default), 2 (10%); digits 1 (default)"
    assert table.choose("tinylm").version == "2"  # the draw 0.05 falls in the canary's 10 %
    assert table.has_version("tinylm", "2") and not table.has_version("tinylm", "3")
    assert watcher.poll() is None


def test_bad_routing_file_keeps_the_old_routes_and_says_so_once(tmp_path, clock, caplog):
    path = tmp_path / "routing.yaml"
    write(path, CANARY_10, 1_000_000_000)
    table, _ = discovered_table(clock, load_routing_file(path), rng=FixedRng(0.05))
    watcher = watch(path, table)

    write(path, CANARY_10.replace("canary_percent: 10", "canary_percent: 150"), 2_000_000_000)
    with caplog.at_level(logging.ERROR):
        result = watcher.poll()
        assert watcher.poll() is None  # not re-read until the file changes again

    assert not result.applied
    assert result.reason == (f"{path}: model 'tinylm': field 'versions.2.canary_percent': "
                             f"must be a number in [0, 100], got 150")
    assert table.choose("tinylm").version == "2"
    refusals = [r.getMessage() for r in caplog.records]
    assert refusals == [f"refused routing file, keeping the previous one (tinylm 1 (default), 2 (10%); "
                        f"digits 1 (default)): {result.reason}"]


@pytest.mark.parametrize(
    ("text", "problem"),
    [("models: [\n", "not valid YAML"), ("models: {}\n", "field 'models': must be a non-empty mapping")],
)
def test_unreadable_or_empty_file_is_refused(tmp_path, clock, text, problem):
    path = tmp_path / "routing.yaml"
    write(path, BASELINE, 1_000_000_000)
    table, _ = discovered_table(clock, load_routing_file(path))
    watcher = watch(path, table)
    write(path, text, 2_000_000_000)
    result = watcher.poll()
    assert not result.applied and result.reason.startswith(f"{path}: ") and problem in result.reason
    assert table.choose("digits").version == "1"


def test_missing_file_is_refused_and_the_old_routes_stay(tmp_path, clock):
    path = tmp_path / "routing.yaml"
    write(path, BASELINE, 1_000_000_000)
    table, _ = discovered_table(clock, load_routing_file(path))
    watcher = watch(path, table)
    path.unlink()
    result = watcher.poll()
    assert not result.applied and result.reason.startswith(f"{path}: cannot read:")
    assert table.choose("tinylm").version == "1"


def test_a_route_chosen_before_a_reload_keeps_its_version_and_endpoint(clock):
    table, _ = discovered_table(clock, parse_routing_config({"models": {"m": {
        "default_version": "1", "endpoints": [A]}}}, "r.yaml"))
    before = table.choose("m")
    table.replace(parse_routing_config({"models": {"m": {"default_version": "2", "endpoints": [B]}}}, "r.yaml"))
    assert (before.version, before.endpoint) == ("1", A)
    assert (table.choose("m").version, table.choose("m").endpoint) == ("2", B)
    with pytest.raises(NotFound, match="unknown version '1' of model 'm'"):
        table.choose("m", "1")


def test_versions_without_endpoints_go_to_discovered_schedulers_with_the_version(clock):
    table, membership = discovered_table(clock, parse_routing_config({"models": {"tinylm": {
        "default_version": "1", "versions": {"2": {"canary_percent": 10}}}}}, "r.yaml"))
    membership.update(A, ["tinylm"])
    route = table.choose("tinylm")
    assert (route.version, route.endpoint) == ("1", A)  # only A serves the model ready
    assert table.choose("tinylm", "2").version == "2"
    assert table.endpoints() == (A, B)  # polled for pressure and ListModels
    with pytest.raises(NotFound, match="unknown model 'digits'"):
        table.choose("digits")  # a routing file names every model the gateway serves


def test_discovered_canary_goes_where_the_version_is_ready_and_falls_back_when_none_has_it(clock):
    ready: dict[tuple[str, str], frozenset[str]] = {("tinylm", "1"): frozenset({A, B})}
    routes = parse_routing_config({"models": {"tinylm": {
        "default_version": "1", "versions": {"2": {"canary_percent": 50}}}}}, "r.yaml")
    table, _ = discovered_table(clock, routes, rng=FixedRng(0.1),
                                serving=lambda model, version: ready.get((model, version), frozenset()))
    assert table.choose("tinylm").version == "1", "no scheduler has version 2 ready: the default serves"

    ready["tinylm", "2"] = frozenset({B})
    route = table.choose("tinylm")
    assert (route.version, route.endpoint) == ("2", B)
