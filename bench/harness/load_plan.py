"""What a load run sends and when (bench_overload, bench_token_path): requests on a Poisson schedule.

Pure data and arithmetic, no grpc: the load processes (bench/harness/load_pool.py)
only replay a plan. Every request message is serialized before the run, so the
send path does no protobuf work; the plan is dealt round-robin over N load
processes, each replaying its share against the same start time.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class Rpc(enum.Enum):
    CLASSIFY = "classify"  # unary Inference/Classify
    GENERATE = "generate"  # server-streaming Inference/Generate


@dataclass(frozen=True)
class RequestTemplate:
    """One serialized request body and who sends it."""

    rpc: Rpc
    body: bytes  # serialized ClassifyRequest / GenerateRequest
    api_key: str
    tenant: str  # label the results are grouped by
    deadline_s: float  # gRPC deadline, from the scheduled send time


@dataclass(frozen=True)
class Send:
    scheduled_s: float  # seconds after the plan's start
    template: int  # index into LoadPlan.templates


@dataclass(frozen=True)
class LoadPlan:
    templates: tuple[RequestTemplate, ...]
    sends: tuple[Send, ...]  # in scheduled order
    duration_s: float  # the schedule's length (the last send is before it)


def poisson_times_s(rate_per_s: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a Poisson process in [0, duration_s), increasing."""
    if rate_per_s < 0 or duration_s < 0:
        raise ValueError(f"rate_per_s and duration_s must be >= 0, got {rate_per_s} and {duration_s}")
    if rate_per_s == 0 or duration_s == 0:
        return np.empty(0)
    # Draw a few standard deviations more gaps than expected, then top up in the rare case they fall short.
    expected = rate_per_s * duration_s
    times = np.cumsum(rng.exponential(1.0 / rate_per_s, int(expected + 6 * np.sqrt(expected) + 16)))
    while times[-1] < duration_s:
        more = times[-1] + np.cumsum(rng.exponential(1.0 / rate_per_s, int(expected) + 16))
        times = np.concatenate([times, more])
    return times[times < duration_s]


@dataclass(frozen=True)
class Stream:
    """One tenant's open-loop arrivals: `rate_per_s` Poisson over `duration_s`, cycling `templates`."""

    templates: tuple[RequestTemplate, ...]
    rate_per_s: float
    duration_s: float
    start_s: float = 0.0  # offset of this stream's first possible arrival in the plan


def build_plan(streams: Sequence[Stream], seed: int) -> LoadPlan:
    """Merges the streams' arrivals into one time-ordered plan (each stream its own random stream)."""
    templates: list[RequestTemplate] = []
    sends: list[Send] = []
    duration_s = 0.0
    for index, stream in enumerate(streams):
        if not stream.templates:
            raise ValueError(f"stream {index} has no request templates")
        first = len(templates)
        templates.extend(stream.templates)
        times = poisson_times_s(stream.rate_per_s, stream.duration_s, np.random.default_rng([seed, index]))
        sends.extend(Send(stream.start_s + float(t), first + i % len(stream.templates)) for i, t in enumerate(times))
        duration_s = max(duration_s, stream.start_s + stream.duration_s)
    sends.sort(key=lambda s: s.scheduled_s)
    return LoadPlan(tuple(templates), tuple(sends), duration_s)


def split_plan(plan: LoadPlan, num_parts: int) -> list[LoadPlan]:
    """Deals the sends round-robin over `num_parts` plans; their union is the original schedule."""
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    return [LoadPlan(plan.templates, plan.sends[part::num_parts], plan.duration_s) for part in range(num_parts)]


def num_load_procs(rate_per_s: float, per_proc_per_s: float, max_procs: int) -> int:
    """Load processes for a total rate: one per `per_proc_per_s` started, at least 1, at most `max_procs`."""
    if per_proc_per_s <= 0 or max_procs < 1:
        raise ValueError(f"per_proc_per_s must be > 0 and max_procs >= 1, got {per_proc_per_s}, {max_procs}")
    return max(1, min(max_procs, int(np.ceil(rate_per_s / per_proc_per_s))))


def request_start_header(origin_unix_s: float, scheduled_s: float) -> tuple[str, str]:
    """`x-request-start: t=<unix microseconds>` for a send scheduled `scheduled_s` after the origin.

    The convention of Envoy/NewRelic: the time the request was due, so a server can tell how long
    it waited before its handler ran."""
    return ("x-request-start", f"t={round((origin_unix_s + scheduled_s) * 1e6)}")
