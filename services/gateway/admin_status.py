"""The gateway's Admin service: what it has in force (GetStatus), a rollout by hand (ControlRollout),
and which callers may use it (the same admin tenants for both).

`collect(gateway)` reads the live objects into a `GatewayView` of plain data; `build_report`
turns a view into a StatusReport (pure: unit tests give it hand-made views). Tenants appear
with their id, priority, weight, models and quotas: never a key or a key's digest.

Facts: tls (off | server TLS | mTLS), tenants_file, quota_store, num_in_flight, max_in_flight.
Sections (columns are the JSON contract, docs/operations.md):
  schedulers: address, state (healthy | not_ready | breaker_open | breaker_half_open |
              unreachable), ready_models, queue_depth (summed over its models)
  scheduler_models: address, model, queue_depth, num_workers, kv_usage, num_slots
  models: model, version, default, canary_percent, endpoints, ready
  tenants: id, priority, weight, allowed_models, requests_per_s, requests_burst,
           tokens_per_s, tokens_burst, max_in_flight, admin
  limits: model, limit, num_in_flight, num_slots
  rollouts: model, canary_version, state (running | paused | rolled_back | promoted | aborted),
            step ("10% (3/5)"), canary_percent, num_baseline, num_canary (this step's samples; at
            the shadow step the compared mirrored calls), last_decision (with its evidence)
The models section's canary_percent is the share in force: a rollout's, else the routing file's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from services.common import admin, build_info
from services.common.errors import NotFound, PermissionDenied
from services.gateway.fronts.caller import grpc_authorization
from services.gateway.rollout.controller import HandAction, RolloutController, RolloutView
from services.gateway.routing.circuit_breaker import BreakerState
from services.gateway.routing.pressure import PressureReport
from services.gateway.tenants.directory import Tenant, TenantDirectory


@dataclass(frozen=True)
class SchedulerView:
    address: str
    reachable: bool
    breaker: BreakerState
    ready_models: tuple[str, ...]
    pressure: tuple[PressureReport, ...]

    @property
    def state(self) -> str:
        if not self.reachable:
            return "unreachable"
        if self.breaker is not BreakerState.CLOSED:
            return f"breaker_{self.breaker.value}"
        return "healthy" if self.ready_models else "not_ready"  # draining, or no worker attached


@dataclass(frozen=True)
class VersionView:
    model: str
    version: str
    default: bool
    canary_percent: float
    endpoints: tuple[str, ...]  # empty: the discovered schedulers
    ready: bool


@dataclass(frozen=True)
class LimitView:
    model: str
    limit: float
    num_in_flight: int
    num_slots: int


@dataclass(frozen=True)
class GatewayView:
    uptime_s: float
    tls: str  # off | server TLS | mTLS
    tenants_source: str  # the tenants file, or "" in anonymous mode
    tenants: tuple[Tenant, ...]
    quota_store: str  # local | leased from ADDRESS | fallback (ADDRESS unreachable)
    num_in_flight: int
    max_in_flight: int
    schedulers: tuple[SchedulerView, ...]
    versions: tuple[VersionView, ...]
    limits: tuple[LimitView, ...]
    rollouts: tuple[RolloutView, ...] = ()


def build_report(view: GatewayView) -> admin.StatusReport:
    return admin.StatusReport(
        service="gateway",
        version=build_info.VERSION,
        uptime_s=view.uptime_s,
        facts=admin.facts({
            "tls": view.tls,
            "tenants_file": view.tenants_source or "none (anonymous mode: every caller is tenant 'anonymous')",
            "quota_store": view.quota_store,
            "num_in_flight": view.num_in_flight,
            "max_in_flight": view.max_in_flight,
        }),
        sections=(
            admin.section("schedulers", ("address", "state", "ready_models", "queue_depth"), (
                (s.address, s.state, admin.joined(s.ready_models), sum(p.queue_depth for p in s.pressure))
                for s in view.schedulers
            )),
            admin.section("scheduler_models", ("address", "model", "queue_depth", "num_workers", "kv_usage",
                                               "num_slots"), (
                (s.address, p.model, p.queue_depth, p.num_workers, round(p.kv_usage, 4), p.num_slots)
                for s in view.schedulers for p in sorted(s.pressure, key=lambda p: p.model)
            )),
            admin.section("models", ("model", "version", "default", "canary_percent", "endpoints", "ready"), (
                (v.model, v.version, v.default, v.canary_percent, admin.joined(v.endpoints) or "discovered", v.ready)
                for v in view.versions
            )),
            admin.section("tenants", ("id", "priority", "weight", "allowed_models", "requests_per_s",
                                      "requests_burst", "tokens_per_s", "tokens_burst", "max_in_flight", "admin"), (
                (t.tenant_id, t.priority.name.lower(), t.weight, admin.joined(t.allowed_models),
                 t.quota.requests_per_s, t.quota.requests_burst, t.quota.tokens_per_s, t.quota.tokens_burst,
                 t.quota.max_in_flight, t.admin)
                for t in view.tenants
            )),
            admin.section("limits", ("model", "limit", "num_in_flight", "num_slots"), (
                (limit.model, round(limit.limit, 1), limit.num_in_flight, limit.num_slots) for limit in view.limits
            )),
            admin.section("rollouts", ("model", "canary_version", "state", "step", "canary_percent", "num_baseline",
                                       "num_canary", "last_decision"), (
                (r.model, r.canary_version, r.state, f"{r.step} ({r.step_index + 1}/{r.num_steps})", r.canary_percent,
                 r.num_baseline, r.num_canary, r.last_decision)
                for r in view.rollouts
            )),
        ),
    )


# --------------------------------------------------------------------------- reading the live gateway


def _versions(gateway) -> tuple[VersionView, ...]:
    ready = {(info.model.name, info.model.version): info.ready for info in gateway.catalog.all_models()}
    rows = []
    routed = set()
    for route in gateway.routing.models:
        routed.add(route.model)
        shares = gateway.routing.shares(route.model)  # a rollout's share in force, else the file's
        for v in route.versions:
            rows.append(VersionView(route.model, v.version, v.version == route.default_version,
                                    shares.get(v.version, 0.0),
                                    tuple(e.address for e in v.endpoints), ready.get((route.model, v.version), False)))
    for (name, version), is_ready in sorted(ready.items()):
        if name not in routed:  # reported by a scheduler, routed by discovery: no file entry
            rows.append(VersionView(name, version, False, 0.0, (), is_ready))
    return tuple(rows)


def _schedulers(gateway) -> tuple[SchedulerView, ...]:
    names = sorted({info.model.name for info in gateway.catalog.all_models()})
    states: Mapping[str, BreakerState] = gateway.breakers.states()
    return tuple(
        SchedulerView(
            address=endpoint,
            reachable=endpoint in gateway.poller.reachable,
            breaker=states.get(endpoint, BreakerState.CLOSED),
            ready_models=tuple(n for n in names if gateway.membership.serves(endpoint, n)),
            pressure=tuple(p for p in (gateway.board.report(endpoint, n) for n in names) if p is not None),
        )
        for endpoint in sorted(gateway.routing.endpoints())
    )


def _quota_store(gateway, address: str) -> str:
    if gateway.quota_sync is None:
        return "local (this gateway's own buckets)"
    mode = gateway.quotas.mode.value
    return f"leased from {address}" if mode == "leased" else f"fallback ({address} unreachable: quota / gateways)"


def collect(gateway, config, started_s: float, clock=time.monotonic) -> GatewayView:
    """`gateway`: a running GatewayService (server.py); `config`: its GatewayConfig."""
    directory: TenantDirectory | None = gateway.watcher.directory if gateway.watcher is not None else None
    return GatewayView(
        uptime_s=clock() - started_s,
        tls=admin.tls_mode(config, client_certs_by_default=False),
        tenants_source=str(gateway.watcher.path) if gateway.watcher is not None else "",
        tenants=directory.tenants if directory is not None else (),
        quota_store=_quota_store(gateway, config.quota_store_address),
        num_in_flight=gateway.limiter.num_in_flight,
        max_in_flight=gateway.limiter.max_in_flight,
        schedulers=_schedulers(gateway),
        versions=_versions(gateway),
        limits=tuple(LimitView(name, limit.limit, limit.num_in_flight, limit.num_slots)
                     for name, limit in sorted(gateway.limits.limits().items())),
        rollouts=tuple(gateway.rollouts.views()) if gateway.rollouts is not None else (),
    )


# --------------------------------------------------------------------------- who may ask


def authorize(directory: TenantDirectory | None, authorization: str | None, peer: str) -> None:
    """An admin tenant's key; in anonymous mode (no tenants file), loopback callers only.

    Raises Unauthenticated (no key, unknown key) or PermissionDenied (a tenant without `admin: true`)."""
    if directory is None:
        admin.check_loopback(peer, "the gateway runs without a tenants file, so no tenant can be an admin")
        return
    tenant = directory.authenticate(authorization)
    if not tenant.admin:
        raise PermissionDenied(f"tenant '{tenant.tenant_id}' may not use the gateway's Admin service "
                               "(status, rollouts): "
                               "set 'admin: true' on an operator's tenant in the tenants file")


def control_rollout(rollouts: RolloutController | None, model: str, action: str, who: str) -> admin.RolloutOutcome:
    """Admin/ControlRollout on this gateway's controller (None: no routing file, so no rollouts)."""
    if rollouts is None:
        raise NotFound(f"model {model!r} has no rollout: this gateway runs without a routing file")
    decision, view = rollouts.control(model, HandAction(action), who)
    return admin.RolloutOutcome(view.model, view.canary_version, view.state,
                                f"{view.step} ({view.step_index + 1}/{view.num_steps})", view.canary_percent,
                                decision.describe() if decision is not None else "")


def handlers(gateway, config, clock=time.monotonic) -> tuple[admin.Authorize, admin.Report, admin.ControlRollout]:
    """The AdminServicer's callables for a GatewayService (server.py wires them)."""
    started_s = clock()

    def authorize_call(peer: str, metadata, has_cert: bool) -> None:
        directory = gateway.watcher.directory if gateway.watcher is not None else None
        authorize(directory, grpc_authorization(metadata), peer)

    return (authorize_call, lambda: build_report(collect(gateway, config, started_s, clock)),
            lambda model, action, who: control_rollout(gateway.rollouts, model, action, who))
