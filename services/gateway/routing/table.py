"""Routing table: model name → version → scheduler endpoint.

Config (a mapping, e.g. the `models` section of the gateway's routing YAML):

    models:
      digits:
        default_version: "1"
        endpoints: ["127.0.0.1:50061"]          # every version, unless it lists its own
      tinylm:
        default_version: "1"
        endpoints:
          - {address: "10.0.0.5:50061", weight: 3}
          - {address: "10.0.0.6:50061", weight: 1}
        versions:
          "2": {canary_percent: 10}            # 10% of version-less requests; the default gets the rest
      classifier:
        default_version: "3"                   # no endpoints: the discovered schedulers (below)

A model may carry a `rollout` policy (format in rollout/policy.py): the rollout controller
(rollout/controller.py) then sets its canary's share step by step (`set_shares`), in place of the file's
`canary_percent`.

A request naming a version goes to that version. A version-less request goes
to a canary with its `canary_percent` chance, else to the default version; a
canary with no available endpoint falls back to the default, so a broken
canary never fails requests that did not ask for it. Within a version, an
endpoint is drawn by weight among those whose circuit breaker lets a call
through; a retry passes the endpoints it already tried in `exclude`. A version
without endpoints (the model lists none either) goes to the schedulers the
gateway discovers (`scheduler_address`), chosen as for a model without a route,
with the version named in the call: the file then decides only which version
serves a request, which is what a canary on Kubernetes needs.

The routing file is reloaded when it changes (`load_routing_file` with
services/common/file_watch.py); `RoutingTable.replace` swaps the routes in one assignment, so a
call that already chose its route keeps it.

With a routing config, a model it does not name is NOT_FOUND at the gateway.
Without one, every model goes to the discovered schedulers with
the version the client named, or none (a scheduler then serves the only version
it has attached): `replicas` (replicas.py) picks one among those serving the
model, by affinity and pressure. A table with a single `fallback_endpoint`
sends every model there (tests, one scheduler).
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.common.errors import NotFound, Unavailable
from services.common.priority import Priority
from services.gateway.rollout.policy import RolloutPolicy, parse_rollout_policy
from services.gateway.routing.circuit_breaker import BreakerPermit, CircuitBreakers
from services.gateway.routing.replicas import ReplicaSelector

# (model, version) -> the endpoints whose last ListModels reported that version ready.
VersionServing = Callable[[str, str], Collection[str]]


class RoutingConfigError(ValueError):
    """The routing config is unusable; the message names source, model and field."""


@dataclass(frozen=True)
class Endpoint:
    # host:port of a scheduler.
    address: str
    # Relative share among the version's endpoints, > 0.
    weight: float = 1.0


@dataclass(frozen=True)
class VersionRoute:
    version: str
    # Empty in a routing file's version without endpoints: the discovered schedulers.
    endpoints: tuple[Endpoint, ...]
    # Share of version-less requests, [0, 100]; the default version's is the remainder.
    canary_percent: float = 0.0


@dataclass(frozen=True)
class ModelRoute:
    model: str
    default_version: str
    versions: tuple[VersionRoute, ...]
    # The automatic canary analysis' policy; None: the versions' canary_percent is the share.
    rollout: RolloutPolicy | None = None

    def version(self, version: str) -> VersionRoute | None:
        return next((v for v in self.versions if v.version == version), None)

    @property
    def default(self) -> VersionRoute:
        """The default version's route (every parsed or discovered ModelRoute has one)."""
        route = self.version(self.default_version)
        if route is None:
            raise ValueError(f"model {self.model!r}: no route for its default version {self.default_version!r}")
        return route


@dataclass(frozen=True)
class Route:
    """Where one attempt goes. Report its outcome through `permit`."""

    model: str
    version: str
    endpoint: str
    permit: BreakerPermit


@dataclass(frozen=True)
class Candidates:
    """Where a call for one model version may go now: the routing table's one answer
    (`RoutingTable.candidates`), which `choose` draws from and the dispatcher asks before failing over."""

    model: str
    # The version's route, its endpoints resolved: a version without its own, the discovered schedulers.
    route: VersionRoute
    # Its endpoints outside the call's `exclude` whose breakers let a call through, in the route's order.
    untried: tuple[Endpoint, ...]
    # The endpoints came from discovery: the replica selector picks among them, not the weights.
    discovered: bool


# --------------------------------------------------------------------------- parsing


def load_routing_file(path: str | os.PathLike) -> tuple[ModelRoute, ...]:
    """The routes in a routing YAML file; RoutingConfigError names the file and what is wrong."""
    source = str(path)
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise RoutingConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise RoutingConfigError(f"{source}: not UTF-8 text: {exc}") from None
    except yaml.YAMLError as exc:
        raise RoutingConfigError(f"{source}: not valid YAML: {exc}") from None
    return parse_routing_config(data, source)


def describe_routes(routes: tuple[ModelRoute, ...]) -> str:
    """One line for logs: each model's versions and canary shares ("tinylm 1 (default), 2 (10%)")."""
    def version(route: ModelRoute, v: VersionRoute) -> str:
        return f"{v.version} (default)" if v.version == route.default_version else f"{v.version} ({v.canary_percent:g}%)"

    def versions(route: ModelRoute) -> list[VersionRoute]:
        return sorted(route.versions, key=lambda v: v.version != route.default_version)

    def rollout(route: ModelRoute) -> str:
        if route.rollout is None:
            return ""
        steps = ", ".join(s.name for s in route.rollout.steps)
        return f", rollout of {route.rollout.canary_version} ({steps}; {route.rollout.override.value})"

    return "; ".join(f"{r.model} {', '.join(version(r, v) for v in versions(r))}{rollout(r)}" for r in routes)


def parse_routing_config(data: object, source: str) -> tuple[ModelRoute, ...]:
    if not isinstance(data, Mapping) or not isinstance(data.get("models"), Mapping) or not data["models"]:
        raise RoutingConfigError(
            f"{source}: field 'models': must be a non-empty mapping of model name to route"
        )
    return tuple(_parse_model(str(name), spec, source) for name, spec in data["models"].items())


def _parse_model(name: str, spec: object, source: str) -> ModelRoute:
    def fail(field_name: str, problem: str) -> RoutingConfigError:
        return RoutingConfigError(f"{source}: model '{name}': field '{field_name}': {problem}")

    if not isinstance(spec, Mapping):
        raise fail("", "must be a mapping")
    unknown = sorted(set(spec) - {"default_version", "endpoints", "versions", "rollout"})
    if unknown:
        raise fail(unknown[0], "unknown field (expected default_version, endpoints, versions, rollout)")
    default_version = spec.get("default_version")
    if (
        not isinstance(default_version, str | int)
        or isinstance(default_version, bool)
        or str(default_version) == ""
    ):
        raise fail("default_version", 'is required: a version string such as "1"')
    default_version = str(default_version)
    shared = _parse_endpoints(spec["endpoints"], "endpoints", fail) if "endpoints" in spec else None
    version_specs = spec.get("versions") or {}
    if not isinstance(version_specs, Mapping):
        raise fail("versions", "must be a mapping of version to {endpoints, canary_percent}")
    version_specs = {str(v): s for v, s in version_specs.items()}
    version_specs.setdefault(default_version, {})
    versions = tuple(
        _parse_version(version, vspec, version == default_version, shared, fail)
        for version, vspec in version_specs.items()
    )
    total_canary = sum(v.canary_percent for v in versions)
    if total_canary > 100:
        raise fail("versions", f"canary_percent values add up to {total_canary:g}, more than 100")
    rollout = None
    if spec.get("rollout") is not None:
        rollout = parse_rollout_policy(spec["rollout"], default_version, tuple(v.version for v in versions),
                                       lambda field_name, problem: fail(field_name, problem))
    return ModelRoute(model=name, default_version=default_version, versions=versions, rollout=rollout)


def _parse_version(version: str, spec: object, is_default: bool, shared, fail) -> VersionRoute:
    where = f"versions.{version}"
    if spec is None:
        spec = {}
    if not isinstance(spec, Mapping):
        raise fail(where, "must be a mapping with endpoints and/or canary_percent")
    unknown = sorted(set(spec) - {"endpoints", "canary_percent"})
    if unknown:
        raise fail(f"{where}.{unknown[0]}", "unknown field (expected endpoints, canary_percent)")
    canary_percent = spec.get("canary_percent", 0)
    if is_default and "canary_percent" in spec:
        raise fail(f"{where}.canary_percent", "not allowed on the default version (it gets the remainder)")
    if (
        isinstance(canary_percent, bool)
        or not isinstance(canary_percent, int | float)
        or not 0 <= canary_percent <= 100
    ):
        raise fail(f"{where}.canary_percent", f"must be a number in [0, 100], got {canary_percent!r}")
    if "endpoints" in spec:
        endpoints = _parse_endpoints(spec["endpoints"], f"{where}.endpoints", fail)
    else:
        endpoints = shared or ()  # none: the discovered schedulers
    return VersionRoute(version=version, endpoints=endpoints, canary_percent=float(canary_percent))


def _parse_endpoints(value: object, field_name: str, fail) -> tuple[Endpoint, ...]:
    if not isinstance(value, list) or not value:
        raise fail(field_name, "must be a non-empty list of 'host:port' or {address, weight}")
    endpoints = []
    for index, item in enumerate(value):
        where = f"{field_name}[{index}]"
        address, weight = (item, 1.0) if isinstance(item, str) else (None, None)
        if isinstance(item, Mapping):
            address, weight = item.get("address"), item.get("weight", 1.0)
        if not isinstance(address, str) or ":" not in address:
            raise fail(where, f"address must be 'host:port', got {address!r}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise fail(where, f"weight must be a number > 0, got {weight!r}")
        endpoints.append(Endpoint(address=address, weight=float(weight)))
    addresses = [e.address for e in endpoints]
    if len(set(addresses)) != len(addresses):
        raise fail(field_name, "lists an address twice")
    return tuple(endpoints)


# --------------------------------------------------------------------------- choosing


class RoutingTable:
    def __init__(
        self,
        routes: Iterable[ModelRoute],
        breakers: CircuitBreakers,
        rng: Callable[[], float] = random.random,
        *,
        fallback_endpoint: str | None = None,
        replicas: ReplicaSelector | None = None,
        serving: VersionServing | None = None,
    ) -> None:
        """serving: the endpoints that last reported a model version ready (pressure_poller's
        ModelCatalog); narrows a discovered version's schedulers to those that have it, and a
        canary nobody serves falls back to the default version."""
        self._routes = {route.model: route for route in routes}
        self._versions = _version_pairs(self._routes)
        # A table with routes (a routing file) knows only its models; discovery then only finds
        # the schedulers for versions that list no endpoints.
        self._routed_only = bool(self._routes)
        self._breakers = breakers
        self._rng = rng
        self._fallback = None if fallback_endpoint is None else (Endpoint(address=fallback_endpoint),)
        self._replicas = replicas
        self._serving = serving
        # model -> version -> share of version-less requests, set by the rollout controller; a model
        # here ignores its versions' canary_percent.
        self._shares: dict[str, dict[str, float]] = {}

    @property
    def models(self) -> tuple[ModelRoute, ...]:
        return tuple(self._routes.values())

    def replace(self, routes: Iterable[ModelRoute]) -> None:
        """A (re)loaded routing file's routes, which the table then knows alone; calls that already
        chose a route keep it."""
        by_model = {route.model: route for route in routes}
        self._routes, self._versions = by_model, _version_pairs(by_model)
        self._routed_only = True

    def set_shares(self, model: str, shares: Mapping[str, float] | None) -> None:
        """The canary shares (version -> percent) the rollout controller decided; None: the file's."""
        if shares is None:
            self._shares.pop(model, None)
        else:
            self._shares[model] = dict(shares)

    def shares(self, model: str) -> dict[str, float]:
        """The shares of version-less requests in force for `model`'s canaries (version -> percent)."""
        route = self._routes.get(model)
        if route is None:
            return {}
        overridden = self._shares.get(model)
        if overridden is not None:
            return dict(overridden)
        return {v.version: v.canary_percent for v in route.versions if v.canary_percent > 0}

    def endpoints(self) -> tuple[str, ...]:
        """Every scheduler address in the table (to dial, and to poll for pressure)."""
        seen = dict.fromkeys(
            e.address for r in self._routes.values() for v in r.versions for e in v.endpoints
        )
        seen.update(dict.fromkeys(e.address for e in self._fallback or ()))
        if self._replicas is not None:
            seen.update(dict.fromkeys(self._replicas.membership.live()))
        return tuple(seen)

    def has_route(self, model: str) -> bool:
        """Whether the routing file names `model` (not a fallback or discovered route)."""
        return model in self._routes

    def has_version(self, model: str, version: str) -> bool:
        """Whether the routing file names `version` of `model`."""
        return (model, version) in self._versions

    def model(self, model: str) -> ModelRoute:
        route = self._routes.get(model)
        if route is None:
            endpoints = self._unrouted_endpoints(model)
            if endpoints is not None:
                return ModelRoute(model=model, default_version="", versions=(VersionRoute("", endpoints),))
            raise NotFound(f"unknown model '{model}'")
        return route

    def _unrouted_endpoints(self, model: str) -> tuple[Endpoint, ...] | None:
        """Where a model without a route goes: the replicas serving it, the fallback, or nowhere (None)."""
        if self._routed_only:
            return None
        if self._replicas is not None:
            return _as_endpoints(self._replicas.membership.candidates(model))
        return self._fallback

    def choose(self, model: str, version: str = "", *, exclude: frozenset[str] = frozenset(),
               priority: Priority = Priority.STANDARD, ttft_target_s: float | None = None) -> Route:
        """Pick a version (when `version` is empty) and an endpoint whose breaker admits a call.
        `ttft_target_s`: a Generate's TTFT target; among replicas, those predicted to meet it first.

        Raises NotFound for an unknown model or version, Unavailable when every endpoint's
        breaker is open (with the time until the first one lets a probe through).
        """
        routes = self._routes  # one read: a reload swapping the table mid-call changes nothing here
        model_route = routes.get(model) or self.model(model)
        routed = model in routes
        chosen: VersionRoute | None
        if not routed:  # the fallback: the scheduler resolves the version itself
            chosen = VersionRoute(version, model_route.versions[0].endpoints)
        elif version:
            chosen = model_route.version(version)
            if chosen is None:
                raise NotFound(f"unknown version '{version}' of model '{model}'")
        else:
            chosen = self._draw_version(model_route)
            if chosen.version != model_route.default_version and not self._candidates(
                    model, chosen, exclude, routed, only_serving=True).untried:
                chosen = model_route.default
        endpoint = self._draw_endpoint(self._candidates(model, chosen, exclude, routed), priority, ttft_target_s)
        permit = self._breakers.for_endpoint(endpoint.address).try_acquire()
        if permit is None:  # cannot happen on one event loop: availability was just checked
            raise Unavailable(f"scheduler {endpoint.address} refused the call (circuit open)")
        return Route(model=model, version=chosen.version, endpoint=endpoint.address, permit=permit)

    def candidates(self, model: str, version: str, exclude: frozenset[str] = frozenset()) -> Candidates:
        """Where a call for `version` of `model` may go now, leaving out the endpoints in `exclude`.

        A version the routing file does not name (a reload dropped it after the call chose it)
        answers for the default version. Raises NotFound for a model the table does not route.
        """
        routes = self._routes
        model_route = routes.get(model) or self.model(model)
        routed = model in routes
        chosen = (model_route.version(version) or model_route.default) if routed else model_route.versions[0]
        return self._candidates(model, chosen, exclude, routed)

    def _candidates(self, model: str, version: VersionRoute, exclude: frozenset[str], routed: bool, *,
                    only_serving: bool = False) -> Candidates:
        resolved = self._resolved(model, version, only_serving=only_serving)
        return Candidates(model=model, route=resolved, untried=tuple(self._available(resolved, exclude)),
                          discovered=self._replicas is not None and (not routed or not version.endpoints))

    def _resolved(self, model: str, version: VersionRoute, *, only_serving: bool = False) -> VersionRoute:
        """A routed version without endpoints, with the discovered schedulers: those that reported
        the version ready, else (none known; unless `only_serving`) the model's candidates."""
        if version.endpoints or self._replicas is None:
            return version
        candidates = self._replicas.membership.candidates(model)
        if self._serving is not None:
            ready = self._serving(model, version.version)
            having = tuple(e for e in candidates if e in ready)
            if having or only_serving:
                candidates = having
        return VersionRoute(version.version, _as_endpoints(candidates), version.canary_percent)

    def _draw_version(self, model_route: ModelRoute) -> VersionRoute:
        point = self._rng() * 100
        shares = self._shares.get(model_route.model)
        for version in model_route.versions:
            percent = version.canary_percent if shares is None else shares.get(version.version, 0.0)
            if percent <= 0:
                continue
            if point < percent:
                return version
            point -= percent
        return model_route.default

    def _available(self, version: VersionRoute, exclude: frozenset[str]) -> list[Endpoint]:
        breakers = self._breakers
        return [
            e
            for e in version.endpoints
            if e.address not in exclude and breakers.for_endpoint(e.address).is_available()
        ]

    def note_gone(self, endpoint: str) -> None:
        """A call found `endpoint` gone or draining: discovered models avoid it until it answers a poll."""
        if self._replicas is not None:
            self._replicas.membership.unreachable(endpoint)

    def note_not_serving(self, endpoint: str, model: str) -> None:
        """`endpoint` answered NOT_FOUND for `model`: it is no candidate for it until its next poll."""
        if self._replicas is not None and model not in self._routes:
            self._replicas.membership.not_serving(endpoint, model)

    def _draw_endpoint(self, found: Candidates, priority: Priority = Priority.STANDARD,
                       ttft_target_s: float | None = None) -> Endpoint:
        # Prefer endpoints this request has not tried; fall back to them rather than fail.
        model, version = found.model, found.route
        if not version.endpoints:
            raise Unavailable(f"no scheduler known for model '{model}': discovery has found none yet",
                              retry_after_s=1.0)
        candidates = list(found.untried) or self._available(version, frozenset())
        if not candidates:
            retry_after_s = min(
                self._breakers.for_endpoint(e.address).retry_after_s() for e in version.endpoints
            )
            which = f"model '{model}' version '{version.version}'" if version.version else f"model '{model}'"
            raise Unavailable(
                f"no scheduler available for {which}: circuit open for all {len(version.endpoints)} endpoints",
                retry_after_s=retry_after_s,
            )
        if found.discovered and self._replicas is not None:  # discovered: there are replicas
            address = self._replicas.choose(model, [e.address for e in candidates], priority, ttft_target_s)
            return next(e for e in candidates if e.address == address)
        point = self._rng() * sum(e.weight for e in candidates)
        for endpoint in candidates:
            point -= endpoint.weight
            if point < 0:
                return endpoint
        return candidates[-1]


def _version_pairs(routes: Mapping[str, ModelRoute]) -> frozenset[tuple[str, str]]:
    return frozenset((r.model, v.version) for r in routes.values() for v in r.versions)


@functools.lru_cache(maxsize=1024)
def _as_endpoints(addresses: tuple[str, ...]) -> tuple[Endpoint, ...]:
    return tuple(Endpoint(address=a) for a in addresses)
