"""The knee of a server under open-loop load: the highest offered rate whose p99 stays under a bound
with no errors, searched by doubling the rate until a step fails, then bisecting.

Pure: a step is whatever `run_step(rate)` measures (bench/loadtest/bench_tensor_knee.py runs the load
harness for it), judged here. A step where the load generator fell behind its own schedule (its lag
p99 above `max_lag_p99_ms`) measured the generator, not the server: it is neither a pass nor the
server's failure (unless even the median service time, from each request's actual send, broke the
bound: a server that far past its knee, not a moment's stall of the machine), it is run again once, and a
knee whose next rate up is such a step is only a lower bound. On one shared
box the generator falls behind mostly because the server took the cores, so such steps come near the
server's knee; the report says which bound stopped each search.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from enum import Enum

# Errors a late generator can cause by itself (the deadline runs from the scheduled time; requests still
# out when the step's drain ends are cancelled); any other status is the server's own refusal.
LATENESS_STATUSES = frozenset({"DEADLINE_EXCEEDED", "CANCELLED"})


class Verdict(Enum):
    PASS = "pass"
    FAIL = "fail"  # the server broke a bound
    BEHIND = "behind"  # the generator fell behind: the step says nothing about the server


@dataclass(frozen=True)
class Criteria:
    p99_ms: float = 100.0  # a step passes with p99 strictly below this
    max_lag_p99_ms: float = 10.0  # the generator's lag p99 above this makes the step untrusted
    max_errors: int = 0


@dataclass(frozen=True)
class StepFigures:
    """What one step measured (from the harness's report: latency from each request's scheduled time)."""

    rate_rps: float  # offered
    num_requests: int  # measured (after the step's warm-up)
    num_errors: int
    errors: dict[str, int]
    throughput_rps: float
    p50_ms: float | None  # None when no request succeeded
    p99_ms: float | None
    max_ms: float | None
    service_p50_ms: float | None  # from each request's actual send: what the generator's lateness cannot add to
    service_p99_ms: float | None
    lag_p99_ms: float  # the generator's own lateness against its schedule
    lag_max_ms: float
    load_1m: float | None = None  # the machine's load average as the step ended, where the runner noted it


@dataclass(frozen=True)
class Step:
    figures: StepFigures
    verdict: Verdict
    reasons: tuple[str, ...]  # every bound it broke (empty when it passed)


@dataclass(frozen=True)
class Plan:
    start_rps: float
    max_rps: float
    factor: float = 2.0  # the climb multiplies the rate by this
    refine_steps: int = 2  # bisections between the last passing and the first failing rate
    min_rps: float = 0.0  # when the start fails, the rate is divided down to this (0: start / factor**2)
    behind_retries: int = 1  # a step where the generator fell behind is run again this many times


@dataclass(frozen=True)
class Knee:
    knee_rps: float | None  # the highest passing rate; None when none passed
    first_failing_rps: float | None  # the lowest rate above the knee that did not pass
    bounded_by: str  # what stopped the search above the knee: server | generator | max_rps | no pass
    steps: tuple[Step, ...]  # in the order run

    @property
    def is_lower_bound(self) -> bool:
        """The server's knee may be higher: the search stopped at the generator or at max_rps."""
        return self.bounded_by in ("generator", "max_rps")


def judge(figures: StepFigures, criteria: Criteria) -> tuple[Verdict, tuple[str, ...]]:
    """BEHIND before FAIL: a late generator sends in bursts, and latency from the schedule includes its
    lateness, so the server's figures at that step are not the server's alone. FAIL all the same when the
    median service time (from the actual send, no generator lateness in it) broke the bound (a stall of the
    whole machine, which also makes the generator late, reaches the tail of the service times but not
    their median; a server far past its knee does), or when the server refused requests (shed them, say)."""
    server = []
    if figures.num_requests == 0:
        server.append("no requests measured")
    if figures.num_errors > criteria.max_errors:
        detail = ", ".join(f"{k} {v}" for k, v in sorted(figures.errors.items()))
        server.append(f"{figures.num_errors} errors ({detail})")
    if figures.p99_ms is not None and figures.p99_ms >= criteria.p99_ms:
        server.append(f"p99 {figures.p99_ms:.1f} ms >= {criteria.p99_ms:g} ms")
    if figures.lag_p99_ms > criteria.max_lag_p99_ms:
        lag = f"generator lag p99 {figures.lag_p99_ms:.1f} ms > {criteria.max_lag_p99_ms:g} ms"
        if figures.service_p50_ms is not None and figures.service_p50_ms >= criteria.p99_ms:
            return Verdict.FAIL, (f"service-time p50 {figures.service_p50_ms:.1f} ms >= {criteria.p99_ms:g} ms "
                                  f"even without the generator's lateness", lag, *server)
        refused = sum(n for status, n in figures.errors.items() if status not in LATENESS_STATUSES)
        if refused > criteria.max_errors:
            return Verdict.FAIL, (f"the server refused {refused} requests, whatever the generator's lateness",
                                  lag, *server)
        return Verdict.BEHIND, (lag, *server)
    return (Verdict.FAIL, tuple(server)) if server else (Verdict.PASS, ())


async def find_knee(plan: Plan, criteria: Criteria, run_step: Callable[[float], Awaitable[StepFigures]],
                    on_step: Callable[[Step], None] = lambda step: None) -> Knee:
    """Doubles (`factor`) from start_rps while steps pass, up to max_rps; when the start fails, divides
    down to min_rps; then bisects between the highest pass and the lowest non-pass `refine_steps` times.
    A rate whose step fell behind is run again (behind_retries); its last run decides."""
    if not 0 < plan.start_rps <= plan.max_rps or plan.factor <= 1:
        raise ValueError(f"need 0 < start_rps <= max_rps and factor > 1, got {plan}")
    steps: list[Step] = []
    good: float | None = None
    bad: tuple[float, Verdict] | None = None

    async def attempt(rate: float) -> Verdict:
        nonlocal good, bad
        for _ in range(1 + plan.behind_retries):  # a late generator is often a moment's noise on a shared box
            figures = await run_step(rate)
            verdict, reasons = judge(figures, criteria)
            step = Step(figures, verdict, reasons)
            steps.append(step)
            on_step(step)
            if verdict is not Verdict.BEHIND:
                break
        if verdict is Verdict.PASS:
            good = rate if good is None else max(good, rate)
        elif bad is None or rate < bad[0]:
            bad = (rate, verdict)
        return verdict

    rate = plan.start_rps
    while await attempt(rate) is Verdict.PASS and rate < plan.max_rps:
        rate = min(rate * plan.factor, plan.max_rps)
    min_rps = plan.min_rps or plan.start_rps / plan.factor ** 2
    while good is None and rate / plan.factor >= min_rps * (1 - 1e-9):
        rate /= plan.factor
        await attempt(rate)
    for _ in range(plan.refine_steps):
        if good is None or bad is None:
            break
        await attempt(round((good + bad[0]) / 2, 3))
    if good is None:
        bounded_by = "no pass"
    elif bad is None:
        bounded_by = "max_rps"
    else:
        bounded_by = "server" if bad[1] is Verdict.FAIL else "generator"
    return Knee(good, bad[0] if bad else None, bounded_by, tuple(steps))


def knee_ratio(ours: Knee, peer: Knee) -> tuple[float | None, str]:
    """ours / peer, and how to read it: "exact" (both bounded by their server), ">=" (only ours may be
    higher), "<=" (only the peer's may be), "unknown" (both may be, or a knee is missing)."""
    if ours.knee_rps is None or peer.knee_rps is None:
        return None, "unknown"
    ratio = ours.knee_rps / peer.knee_rps
    if ours.is_lower_bound and peer.is_lower_bound:
        return ratio, "unknown"
    return ratio, ">=" if ours.is_lower_bound else "<=" if peer.is_lower_bound else "exact"


def step_figures(rate_rps: float, report: dict) -> StepFigures:
    """A step's figures from a loadtest report (schema infermesh.loadtest/v1): the overall group and
    the generator's lag."""
    overall, lag = report["overall"], report["generator"]["lag_ms"]
    latency = overall["latency_ms"]
    return StepFigures(
        rate_rps=rate_rps, num_requests=overall["num_requests"], num_errors=overall["num_errors"],
        errors=dict(overall["errors"]), throughput_rps=overall["throughput_rps"],
        p50_ms=latency.get("p50"), p99_ms=latency.get("p99"), max_ms=latency.get("max"),
        service_p50_ms=overall["service_ms"].get("p50"), service_p99_ms=overall["service_ms"].get("p99"),
        lag_p99_ms=lag.get("p99", 0.0), lag_max_ms=lag.get("max", 0.0))


def knee_document(knee: Knee) -> dict:
    return {"knee_rps": knee.knee_rps, "first_failing_rps": knee.first_failing_rps,
            "bounded_by": knee.bounded_by, "is_lower_bound": knee.is_lower_bound,
            "steps": [{**asdict(s.figures), "verdict": s.verdict.value, "reasons": list(s.reasons)}
                      for s in knee.steps]}


def knee_from_document(doc: dict) -> Knee:
    """The Knee that knee_document wrote (a saved run, to set beside another)."""
    steps = tuple(Step(StepFigures(**{k: v for k, v in step.items() if k not in ("verdict", "reasons")}),
                       Verdict(step["verdict"]), tuple(step["reasons"])) for step in doc["steps"])
    return Knee(doc["knee_rps"], doc["first_failing_rps"], doc["bounded_by"], steps)
