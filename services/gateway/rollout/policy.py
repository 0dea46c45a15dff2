"""A model's rollout policy, as the routing file states it under the model's `rollout` field.

    models:
      digits:
        default_version: "1"
        versions:
          "2": {}                          # listed, so requests naming it are routed
        rollout:
          canary_version: "2"
          steps: [shadow, 1, 10, 50, 100]  # shadow: mirrored only; numbers: % of version-less requests
          min_requests: 200                # per step: canary requests (shadow: compared pairs)
          min_duration_s: 60               # per step, and both must be reached to go on
          confidence: 0.95                 # each decision's significance level is 1 - confidence
          shadow_percent: 100              # share of version-less requests mirrored at the shadow step
          shadow_max_in_flight: 4          # the shadow budget: mirrored calls in flight at once
          checks:                          # the first four by default; a check set to false is off
            error_rate: {max_increase: 0.01}
            deadline_misses: {max_increase: 0.01}
            latency: {max_ratio: 1.2, min_increase_ms: 1}  # end to end and every stage: shift and p99
            agreement: {min_agreement: 0.98, max_score_drift: 0.05}
            golden: {cases: [...], interval_s: 30}  # on only with cases (rollout/golden.py)
          override: pause                  # by hand: pause | abort | promote; absent: automatic
          attempt: 1                       # change it to start the rollout again after a rollback

While a rollout policy is present the controller (rollout/controller.py), not `canary_percent`, sets the
canary's share. The policy is plain data; RolloutPolicyError names the field that is wrong.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.gateway.rollout.golden import GoldenCheck, parse_golden

SHADOW = "shadow"


class RolloutPolicyError(ValueError):
    """The rollout policy is unusable; the message names the field."""


class Override(enum.Enum):
    """What an operator set by hand; AUTOMATIC lets the analysis decide."""

    AUTOMATIC = "automatic"
    PAUSE = "pause"  # keep the current share, decide nothing
    ABORT = "abort"  # canary share 0 now, decide nothing
    PROMOTE = "promote"  # the last step's share now, decide nothing


@dataclass(frozen=True)
class Step:
    # Share of version-less requests the canary serves, [0, 100]; 0 with shadow=True at the shadow step.
    percent: float
    # Mirrored only: the client always gets the baseline's answer.
    shadow: bool = False

    @property
    def name(self) -> str:
        return SHADOW if self.shadow else f"{self.percent:g}%"


@dataclass(frozen=True)
class Checks:
    # None: the check is off.
    error_rate_max_increase: float | None = 0.01
    deadline_miss_max_increase: float | None = 0.01
    latency_max_ratio: float | None = 1.2
    # And by more than this: a 0.2 ms stage at 0.4 ms is twice as slow and no regression anyone feels.
    latency_min_increase_ms: float = 1.0
    min_agreement: float | None = 0.98
    # Classify: mean |score difference| of the top label above this counts as a disagreement.
    max_score_drift: float = 0.05
    # Known inputs sent to the canary, answers compared exactly; None: no cases, the check is off.
    golden: GoldenCheck | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RolloutPolicy:
    canary_version: str
    steps: tuple[Step, ...]
    min_requests: int = 100
    min_duration_s: float = 60.0
    confidence: float = 0.95
    shadow_percent: float = 100.0
    shadow_max_in_flight: int = 4
    checks: Checks = field(default_factory=Checks)
    override: Override = Override.AUTOMATIC
    attempt: int = 1

    @property
    def rollout_id(self) -> str:
        """What identifies one rollout: a changed policy (override aside) is a new rollout, from step 0."""
        steps = ",".join(s.name for s in self.steps)
        golden = self.checks.golden
        return (f"v{self.canary_version}#{self.attempt}[{steps}]n{self.min_requests}t{self.min_duration_s:g}"
                f"c{self.confidence:g}{self.checks}"
                + (f"golden({golden.digest},{golden.interval_s:g}s)" if golden is not None else ""))

    def has_shadow(self) -> bool:
        return any(s.shadow for s in self.steps)


Fail = Callable[[str, str], Exception]

_FIELDS = ("canary_version", "steps", "min_requests", "min_duration_s", "confidence", "shadow_percent",
           "shadow_max_in_flight", "checks", "override", "attempt")
_CHECKS = {"error_rate": ("max_increase",), "deadline_misses": ("max_increase",), "latency": ("max_ratio", "min_increase_ms"),
           "agreement": ("min_agreement", "max_score_drift")}
_ALL_CHECKS = (*_CHECKS, "golden")


def parse_rollout_policy(spec: object, default_version: str, versions: tuple[str, ...], fail: Fail) -> RolloutPolicy:
    """The `rollout` field of a model's route; `fail(field, problem)` makes the error to raise."""
    if not isinstance(spec, Mapping):
        raise fail("rollout", "must be a mapping with canary_version and steps")
    unknown = sorted(set(spec) - set(_FIELDS))
    if unknown:
        raise fail(f"rollout.{unknown[0]}", f"unknown field (expected {', '.join(_FIELDS)})")
    canary = spec.get("canary_version")
    if isinstance(canary, bool) or not isinstance(canary, str | int) or str(canary) == "":
        raise fail("rollout.canary_version", 'is required: a version string such as "2"')
    canary = str(canary)
    if canary == default_version:
        raise fail("rollout.canary_version", f"'{canary}' is the default version; the canary must be another")
    if canary not in versions:
        raise fail("rollout.canary_version", f"'{canary}' is not listed under versions")
    return RolloutPolicy(
        canary_version=canary,
        steps=_steps(spec.get("steps"), fail),
        min_requests=_number(spec, "min_requests", 100, fail, integer=True, low=1),
        min_duration_s=_number(spec, "min_duration_s", 60.0, fail, low=0),
        confidence=_number(spec, "confidence", 0.95, fail, low=0.5, high=0.9999, low_open=True),
        shadow_percent=_number(spec, "shadow_percent", 100.0, fail, low=0, high=100, low_open=True),
        shadow_max_in_flight=_number(spec, "shadow_max_in_flight", 4, fail, integer=True, low=1),
        checks=_checks(spec.get("checks", {}), fail),
        override=_override(spec.get("override", "automatic"), fail),
        attempt=_number(spec, "attempt", 1, fail, integer=True, low=0),
    )


def _steps(value: object, fail: Fail) -> tuple[Step, ...]:
    where = "rollout.steps"
    if not isinstance(value, list) or not value:
        raise fail(where, "is required: a non-empty list such as [shadow, 1, 10, 50, 100]")
    steps: list[Step] = []
    for index, item in enumerate(value):
        if item == SHADOW:
            if index != 0:
                raise fail(f"{where}[{index}]", "shadow can only be the first step")
            steps.append(Step(0.0, shadow=True))
            continue
        if isinstance(item, bool) or not isinstance(item, int | float) or not 0 < item <= 100:
            raise fail(f"{where}[{index}]", f"must be 'shadow' or a percent in (0, 100], got {item!r}")
        if steps and not steps[-1].shadow and item <= steps[-1].percent:
            raise fail(f"{where}[{index}]", f"must be above the step before ({steps[-1].percent:g}), got {item!r}")
        steps.append(Step(float(item)))
    return tuple(steps)


def _number(spec: Mapping, name: str, default, fail: Fail, *, integer: bool = False, low: float | None = None,
            high: float | None = None, low_open: bool = False):
    value = spec.get(name, default)
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        raise fail(f"rollout.{name}", f"must be {kind}, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    if too_low or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else f">= {low:g}"
        raise fail(f"rollout.{name}", f"must be {kind} {'in ' if high is not None else ''}{bounds}, got {value!r}")
    return value if integer else float(value)


def _checks(value: object, fail: Fail) -> Checks:
    if not isinstance(value, Mapping):
        raise fail("rollout.checks", f"must be a mapping of {', '.join(_ALL_CHECKS)} to their settings or false")
    unknown = sorted(set(value) - set(_ALL_CHECKS))
    if unknown:
        raise fail(f"rollout.checks.{unknown[0]}", f"unknown check (expected {', '.join(_ALL_CHECKS)})")
    defaults = Checks()
    settings: dict[str, dict] = {}
    for name, allowed in _CHECKS.items():
        raw = value.get(name, {})
        if raw is False:
            settings[name] = {"off": True}
            continue
        if raw is None or raw is True:
            raw = {}
        if not isinstance(raw, Mapping):
            raise fail(f"rollout.checks.{name}", f"must be a mapping of {', '.join(allowed)}, or false (off)")
        extra = sorted(set(raw) - set(allowed))
        if extra:
            raise fail(f"rollout.checks.{name}.{extra[0]}", f"unknown field (expected {', '.join(allowed)})")
        settings[name] = dict(raw)

    def setting(check: str, key: str, default: float | None, low: float, high: float | None) -> float | None:
        if settings[check].get("off"):
            return None
        return _number(settings[check], key, default, lambda f, p: fail(
            f"rollout.checks.{check}.{f.removeprefix('rollout.')}", p), low=low, high=high)

    drift = setting("agreement", "max_score_drift", defaults.max_score_drift, 0, 1)
    min_increase_ms = setting("latency", "min_increase_ms", defaults.latency_min_increase_ms, 0, None)
    return Checks(
        error_rate_max_increase=setting("error_rate", "max_increase", defaults.error_rate_max_increase, 0, 1),
        deadline_miss_max_increase=setting("deadline_misses", "max_increase", defaults.deadline_miss_max_increase,
                                           0, 1),
        latency_max_ratio=setting("latency", "max_ratio", defaults.latency_max_ratio, 1, None),
        latency_min_increase_ms=defaults.latency_min_increase_ms if min_increase_ms is None else min_increase_ms,
        min_agreement=setting("agreement", "min_agreement", defaults.min_agreement, 0, 1),
        max_score_drift=defaults.max_score_drift if drift is None else drift,
        golden=parse_golden(value.get("golden"), fail),
    )


def _override(value: object, fail: Fail) -> Override:
    try:
        return Override(value)
    except ValueError:
        raise fail("rollout.override", f"must be pause, abort or promote (or absent), got {value!r}") from None
