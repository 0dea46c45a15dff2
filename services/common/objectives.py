"""Latency objectives of a generation: time to first token (TTFT) and time per output token (TPOT).

Each priority class has a default pair in the gateway's config; a tenant may set its own in the
tenants file, and a request its own (GenerateRequest.objectives, or the x-infermesh-ttft-ms /
x-infermesh-tpot-ms header or metadata). The most specific one set wins, field by field: request,
then tenant, then class. Every value must lie within the configured bounds: a request outside them
is refused with INVALID_ARGUMENT naming the bound; a tenant's value outside them (the tenants file
does not know the gateway's bounds) is held to the nearer bound.

Pure: no gRPC, no clock. The gateway resolves one request's objective here and sends it on in
GenerateRequest.objectives, so the scheduler judges the same numbers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.priority import Priority

TTFT_KEY = "x-infermesh-ttft-ms"
TPOT_KEY = "x-infermesh-tpot-ms"
# Whole or decimal milliseconds: no sign, exponent, spaces, inf or nan (float() takes them all).
_MS = re.compile(r"^[0-9]{1,9}(\.[0-9]{1,3})?$")


@dataclass(frozen=True)
class ObjectiveOverride:
    """Targets a tenant or a request sets; None: not set here (the next less specific applies)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


NO_OVERRIDE = ObjectiveOverride()


@dataclass(frozen=True)
class LatencyObjective:
    """One request's resolved targets."""

    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True)
class ObjectiveBounds:
    """The range every configured or requested target must lie in, milliseconds (inclusive)."""

    min_ttft_ms: float = 10.0
    max_ttft_ms: float = 600_000.0
    min_tpot_ms: float = 1.0
    max_tpot_ms: float = 60_000.0

    def __post_init__(self) -> None:
        if not 0 < self.min_ttft_ms <= self.max_ttft_ms:
            raise ValueError(f"TTFT bounds must be 0 < min <= max, got {self.min_ttft_ms}..{self.max_ttft_ms} ms")
        if not 0 < self.min_tpot_ms <= self.max_tpot_ms:
            raise ValueError(f"TPOT bounds must be 0 < min <= max, got {self.min_tpot_ms}..{self.max_tpot_ms} ms")

    def problem(self, override: ObjectiveOverride) -> str | None:
        """What is out of bounds in `override`, naming the bound; None when all is within."""
        checks = (("TTFT", override.ttft_ms, self.min_ttft_ms, self.max_ttft_ms),
                  ("TPOT", override.tpot_ms, self.min_tpot_ms, self.max_tpot_ms))
        for name, value, low, high in checks:
            if value is None:
                continue
            if value < low:
                return f"{name} target {value:g} ms is below the minimum {low:g} ms"
            if value > high:
                return f"{name} target {value:g} ms is above the maximum {high:g} ms"
        return None


@dataclass(frozen=True)
class ObjectivePolicy:
    """Per-class defaults and the bounds, from the gateway's config."""

    by_priority: Mapping[Priority, LatencyObjective]
    bounds: ObjectiveBounds = ObjectiveBounds()

    def __post_init__(self) -> None:
        missing = [p.name.lower() for p in Priority if p not in self.by_priority]
        if missing:
            raise ValueError(f"latency objectives need every class, missing {', '.join(missing)}")
        for priority, objective in self.by_priority.items():
            problem = self.bounds.problem(ObjectiveOverride(objective.ttft_ms, objective.tpot_ms))
            if problem is not None:
                raise ValueError(f"{priority.name.lower()} class: {problem}")

    def resolve(self, priority: Priority, tenant: ObjectiveOverride = NO_OVERRIDE,
                request: ObjectiveOverride = NO_OVERRIDE) -> LatencyObjective:
        """The request's targets; raises InvalidArgument naming the bound a request value is outside."""
        problem = self.bounds.problem(request)
        if problem is not None:
            raise InvalidArgument(f"latency objective out of bounds: {problem}")
        default = self.by_priority[priority]
        tenant = self._clamped(tenant)
        return LatencyObjective(
            ttft_ms=_first(request.ttft_ms, tenant.ttft_ms, default.ttft_ms),
            tpot_ms=_first(request.tpot_ms, tenant.tpot_ms, default.tpot_ms),
        )

    def _clamped(self, tenant: ObjectiveOverride) -> ObjectiveOverride:
        b = self.bounds
        return ObjectiveOverride(
            ttft_ms=None if tenant.ttft_ms is None else min(max(tenant.ttft_ms, b.min_ttft_ms), b.max_ttft_ms),
            tpot_ms=None if tenant.tpot_ms is None else min(max(tenant.tpot_ms, b.min_tpot_ms), b.max_tpot_ms),
        )


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


def parse_objective_ms(value: str | bytes | None, key: str) -> float | None:
    """A header or metadata value in milliseconds; None when absent or empty. Raises InvalidArgument."""
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = value.strip()
    if not text:
        return None
    if not _MS.match(text) or float(text) <= 0:
        raise InvalidArgument(f"{key} must be a positive number of milliseconds, got {value[:40]!r}")
    return float(text)


def request_override(field_ttft_ms: int, field_tpot_ms: int, header_ttft: str | bytes | None,
                     header_tpot: str | bytes | None) -> ObjectiveOverride:
    """A request's own targets: the GenerateRequest.objectives fields (0: unset), else the headers.

    Sent both ways with different values, the tighter one counts: a request asks for what it needs."""
    def pick(field_ms: int, header: str | bytes | None, key: str) -> float | None:
        from_header = parse_objective_ms(header, key)
        from_field = float(field_ms) if field_ms > 0 else None
        given = [v for v in (from_field, from_header) if v is not None]
        return min(given) if given else None

    return ObjectiveOverride(ttft_ms=pick(field_ttft_ms, header_ttft, TTFT_KEY),
                             tpot_ms=pick(field_tpot_ms, header_tpot, TPOT_KEY))
