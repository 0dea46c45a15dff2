"""Find the knee: raise the offered rate step by step until an SLO breaks.

A step passes when every class keeps at least `min_goodput_ratio` of its
requests within SLO, the overall error ratio stays at or below
`max_error_ratio`, and the load generator kept its schedule (otherwise the
step measured the harness, not the mesh). After the first failing step the
interval between the last passing and the first failing rate is bisected
`refine_steps` times. The knee is the highest passing rate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from loadtest import SWEEP_SCHEMA
from loadtest.scenario import LoadMode, Scenario, SweepSpec


@dataclass(frozen=True)
class SweepStep:
    rate_rps: float
    passed: bool
    reasons: tuple[str, ...]  # why it failed; empty when it passed
    report: dict


def judge(doc: dict, spec: SweepSpec) -> tuple[str, ...]:
    """Reasons the step broke the SLO (none: it held)."""
    reasons = []
    for name, group in doc["classes"].items():
        if group["num_requests"] and group["goodput_ratio"] < spec.min_goodput_ratio:
            reasons.append(f"class {name}: goodput {group['goodput_ratio']:.1%} < {spec.min_goodput_ratio:.1%}")
    overall = doc["overall"]
    if overall["error_ratio"] > spec.max_error_ratio:
        reasons.append(f"errors {overall['error_ratio']:.1%} > {spec.max_error_ratio:.1%}")
    if overall["num_requests"] == 0:
        reasons.append("no requests measured")
    if doc["generator"]["fell_behind"]:
        reasons.append("load generator fell behind its schedule")
    return tuple(reasons)


def next_rate(rate_rps: float, spec: SweepSpec) -> float:
    return rate_rps * spec.factor if spec.factor else rate_rps + spec.step_rps


def step_scenario(scenario: Scenario, rate_rps: float, spec: SweepSpec) -> Scenario:
    if scenario.load.mode is not LoadMode.OPEN:
        raise ValueError("sweep needs an open-loop scenario (load.mode: open); a closed loop sets no rate")
    stepped = scenario.with_constant_level(rate_rps, spec.step_duration_s)
    return dataclasses.replace(stepped, warmup_s=spec.warmup_s, name=f"{scenario.name}@{rate_rps:g}rps")


async def run_sweep(
    scenario: Scenario,
    spec: SweepSpec,
    run_step: Callable[[Scenario], Awaitable[dict]],
    on_step: Callable[[SweepStep], None] = lambda step: None,
) -> list[SweepStep]:
    steps: list[SweepStep] = []

    async def attempt(rate_rps: float) -> bool:
        doc = await run_step(step_scenario(scenario, rate_rps, spec))
        reasons = judge(doc, spec)
        step = SweepStep(round(rate_rps, 3), not reasons, reasons, doc)
        steps.append(step)
        on_step(step)
        return step.passed

    rate, good, bad = spec.start_rps, None, None
    while rate <= spec.max_rps + 1e-9:
        if await attempt(rate):
            good, rate = rate, next_rate(rate, spec)
        else:
            bad = rate
            break
    for _ in range(spec.refine_steps):
        if good is None or bad is None:
            break
        middle = (good + bad) / 2
        if await attempt(middle):
            good = middle
        else:
            bad = middle
    return steps


def sweep_document(scenario: Scenario, spec: SweepSpec, steps: list[SweepStep], *, target: str,
                   started_at: str) -> dict:
    passing = [s.rate_rps for s in steps if s.passed]
    failing = [s.rate_rps for s in steps if not s.passed]
    knee = max(passing) if passing else None
    return {
        "schema": SWEEP_SCHEMA,
        "meta": {"name": scenario.name, "target": target, "started_at": started_at,
                 "criteria": {"min_goodput_ratio": spec.min_goodput_ratio, "max_error_ratio": spec.max_error_ratio},
                 "step_duration_s": spec.step_duration_s, "warmup_s": spec.warmup_s,
                 "arrival": scenario.load.arrival.value},
        "knee_rps": knee,
        "first_failing_rps": min((r for r in failing if knee is None or r > knee), default=None),
        "reached_max_rps": bool(steps) and not failing,
        "steps": [_step_summary(s) for s in sorted(steps, key=lambda s: s.rate_rps)],
    }


def _step_summary(step: SweepStep) -> dict:
    def brief(group: dict) -> dict:
        stream = group.get("stream") or {}
        return {
            "num_requests": group["num_requests"],
            "throughput_rps": group["throughput_rps"],
            "goodput_ratio": group["goodput_ratio"],
            "error_ratio": group["error_ratio"],
            "latency_ms": group["latency_ms"],
            "ttft_ms": stream.get("ttft_ms"),
            "tail_top_stage": (group.get("tail") or {}).get("top_stage"),
        }

    doc = step.report
    return {
        "rate_rps": step.rate_rps,
        "passed": step.passed,
        "reasons": list(step.reasons),
        "generator_lag_p99_ms": doc["generator"]["lag_ms"].get("p99"),
        "overall": brief(doc["overall"]),
        "classes": {name: brief(group) for name, group in doc["classes"].items()},
    }
