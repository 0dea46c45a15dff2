"""A process's CPU time from /proc, the one way every benchmark reads it."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (raises FileNotFoundError once it is gone)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5), after pid and comm
    return (utime + stime) / CLOCK_TICKS_PER_S


def idle_rates(pids: Mapping[str, int], idle_s: float) -> dict[str, float]:
    """Each process's CPU seconds per second while nothing is sent to it, over one `idle_s` sleep:
    what a phase's CPU is corrected by (busy_cpu_s)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(idle_s)
    return {name: (cpu_seconds(pid) - before[name]) / idle_s for name, pid in pids.items()}


def busy_cpu_s(pid: int, cpu_before_s: float, idle_cpu_per_s: float, wall_s: float) -> float:
    """The CPU seconds process `pid` spent since `cpu_before_s` (its cpu_seconds then) beyond its idle
    rate over `wall_s`; never below 0."""
    return max(0.0, cpu_seconds(pid) - cpu_before_s - idle_cpu_per_s * wall_s)
