"""Where a benchmark's processes run: all on every core (shared), or the worker on a core of its own (pinned).

On a GPU the worker's compute does not compete with the front end (gateways, scheduler, clients)
for the host's cores; on the 2-core box it does, and under overload the refusals the front end
answers take CPU from the worker's steps (docs/gateway.md, "Latency objectives"). `pinned` gives
the worker the last core and everything else the others, which mimics the GPU deployment on a CPU
box. It is a different machine, not a better run of the same one: figures from it are reported
beside the shared ones, never instead of them, and say which placement they are from.

Affinity is a thread's, not a process's: every thread a process has when it is pinned is moved,
and threads it starts later inherit it from the thread that starts them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from enum import StrEnum
from pathlib import Path


class Placement(StrEnum):
    SHARED = "shared"  # every process may run on every core (the default, as deployed on one host)
    PINNED = "pinned"  # the worker alone on the last core, the rest on the others


def split_cores(cores: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
    """(the worker's cores, everyone else's) for `pinned`: the last core, and the rest."""
    ordered = sorted(cores)
    if len(ordered) < 2:
        raise ValueError(f"pinned placement needs at least 2 cores, this process may use {len(ordered)}")
    return frozenset(ordered[-1:]), frozenset(ordered[:-1])


def pin_process(pid: int, cores: frozenset[int]) -> int:
    """Moves every thread of `pid` onto `cores`; how many threads were moved."""
    moved = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
            moved += 1
        except ProcessLookupError:
            continue  # the thread ended meanwhile
    return moved


def apply(placement: Placement, worker_pids: Iterable[int], other_pids: Iterable[int]) -> dict:
    """Places the processes (this one counts among `other_pids` when it should); what was done, for the report."""
    if placement is Placement.SHARED:
        return {"placement": placement.value}
    worker_cores, other_cores = split_cores(os.sched_getaffinity(0))
    worker_pids, other_pids = list(worker_pids), list(other_pids)
    for pid in worker_pids:
        pin_process(pid, worker_cores)
    for pid in other_pids:
        pin_process(pid, other_cores)
    return {"placement": placement.value, "worker_cores": sorted(worker_cores), "other_cores": sorted(other_cores),
            "num_worker_processes": len(worker_pids), "num_other_processes": len(other_pids)}


def describe(pids: Mapping[str, int]) -> dict[str, list[int]]:
    """The cores each process's main thread may run on now: what the report says was in force."""
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = sorted(os.sched_getaffinity(pid))
        except ProcessLookupError:
            continue
    return out
