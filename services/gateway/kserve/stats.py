"""Triton-style per-model statistics, counted by this gateway for the KServe requests it served.

Per (model, version): requests that succeeded and failed with their whole time at the gateway,
inputs served (a batch of N images counts N), and the cumulative stage durations the response
timings carry back (scheduler queue, worker preprocessing, compute, postprocessing). Counters are
this process's, since it started, as Triton's are; each gateway replica counts its own.

A request refused before a version was chosen (unknown model, bad key) counts nowhere, like
Triton, which never reaches a model for those.

Pure: no grpc, no protobuf; kserve/models.py turns a snapshot into ModelStatisticsResponse.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StageDurations:
    """One served request's stages as the response timings report them, seconds."""

    queue_s: float = 0.0
    compute_input_s: float = 0.0
    compute_infer_s: float = 0.0
    compute_output_s: float = 0.0


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += max(0, round(seconds * 1e9))


@dataclass
class VersionStats:
    name: str
    version: str
    # When the last request finished, ms since the epoch; 0 before any.
    last_inference_ms: int = 0
    num_inferences: int = 0
    num_executions: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


class ModelStatistics:
    def __init__(self, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall_clock = wall_clock
        self._stats: dict[tuple[str, str], VersionStats] = {}

    def succeeded(self, name: str, version: str, duration_s: float, stages: StageDurations,
                  num_inferences: int = 1) -> None:
        stats = self._entry(name, version)
        stats.success.add(duration_s)
        stats.queue.add(stages.queue_s)
        stats.compute_input.add(stages.compute_input_s)
        stats.compute_infer.add(stages.compute_infer_s)
        stats.compute_output.add(stages.compute_output_s)
        stats.num_inferences += num_inferences
        stats.num_executions += 1

    def failed(self, name: str, version: str, duration_s: float) -> None:
        self._entry(name, version).fail.add(duration_s)

    def snapshot(self, name: str = "", version: str = "") -> list[VersionStats]:
        """Every counted version (of `name`, at `version`, when given), sorted; copies, safe to keep."""
        return [
            VersionStats(**_copied_fields(stats))
            for key, stats in sorted(self._stats.items())
            if (not name or key[0] == name) and (not version or key[1] == version)
        ]

    def _entry(self, name: str, version: str) -> VersionStats:
        stats = self._stats.get((name, version))
        if stats is None:
            stats = self._stats[(name, version)] = VersionStats(name, version)
        stats.last_inference_ms = int(self._wall_clock() * 1000)
        return stats


def _copied_fields(stats: VersionStats) -> dict[str, Any]:
    """The stats' fields by name, each Duration copied (the counters keep moving)."""
    return {k: (Duration(v.count, v.ns) if isinstance(v, Duration) else v) for k, v in vars(stats).items()}
