"""How many compute threads a worker may use: its CPU allocation, not the cores it can see.

torch, OpenMP and Numba default to one thread per visible core. A worker next to the
scheduler and gateway on a small box, or in a Kubernetes pod (which sees the node's
cores, not its CPU limit), then runs more threads than it has CPU time for, and the
CFS quota throttles it mid-step. The allocation, in order of precedence:

1. an explicit count (`--num-threads` / INFERMESH_WORKER_NUM_THREADS > 0; Kubernetes
   fills it from the container's CPU limit through the downward API);
2. OMP_NUM_THREADS when the operator already set it (the benchmarks pin workers to 1);
3. the cgroup CPU quota: v2 `cpu.max` ("<quota> <period>" or "max <period>"), else v1
   `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1: none), the smallest over this
   process's cgroup and its ancestors; ceil(quota / period) threads, at most the CPUs
   this process may run on;
4. the CPUs this process may run on (`os.sched_getaffinity(0)`).

A file that is missing means "no such limit"; one with content that cannot be read as a
quota is logged and skipped, never fatal. No grpc, no torch: the worker applies the
decision (services/worker/thread_settings.py).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ReadText = Callable[[Path], "str | None"]


class ThreadSource(enum.Enum):
    FLAG = "flag"
    OMP_ENV = "OMP_NUM_THREADS"
    CGROUP = "cgroup"
    AFFINITY = "affinity"


CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class CgroupFiles:
    """Where one cgroup level's quota lives. Defaults: the mount root, which inside a container (its
    own cgroup namespace) is the container's cgroup."""

    cpu_max: Path = CGROUP_ROOT / "cpu.max"  # v2 (unified hierarchy)
    cfs_quota_us: Path = CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us"  # v1 cpu controller
    cfs_period_us: Path = CGROUP_ROOT / "cpu" / "cpu.cfs_period_us"


def _ancestors(path: str) -> list[str]:
    """'/a/b' -> ['a/b', 'a', ''] (relative to the mount), innermost first."""
    parts = [p for p in path.split("/") if p]
    if ".." in parts:
        parts = []  # outside our namespace's root: only the root is visible
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_levels(proc_self_cgroup: str | None, root: Path = CGROUP_ROOT) -> tuple[CgroupFiles, ...]:
    """This process's cgroup and each ancestor up to the mount root, innermost first, from the text of
    /proc/self/cgroup ("0::/path" for v2, "N:cpu,cpuacct:/path" for v1). In a container that is the
    root alone; a process in a systemd slice sees its nested path, and a quota on any level caps it."""
    v2_path = v1_path = "/"
    for line in (proc_self_cgroup or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2_path = path or "/"
        elif "cpu" in controllers.split(","):
            v1_path = path or "/"
    v2_levels, v1_levels = _ancestors(v2_path), _ancestors(v1_path)
    levels = []
    for i in range(max(len(v2_levels), len(v1_levels))):
        v2 = root / v2_levels[min(i, len(v2_levels) - 1)]
        v1 = root / "cpu" / v1_levels[min(i, len(v1_levels) - 1)]
        levels.append(CgroupFiles(v2 / "cpu.max", v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us"))
    return tuple(levels)


@dataclass(frozen=True)
class CpuQuota:
    quota_us: int  # CPU time the group may use per period
    period_us: int
    origin: str  # the file(s) it was read from, for the log line

    @property
    def num_cpus(self) -> float:
        return self.quota_us / self.period_us


@dataclass(frozen=True)
class ThreadDecision:
    num_threads: int  # >= 1
    source: ThreadSource
    detail: str  # what the count was derived from, for the start-up log line


def read_text(path: Path) -> str | None:
    """A file's content, or None when it does not exist or cannot be read (no such limit)."""
    try:
        return path.read_text()
    except OSError:
        return None


def _positive_int(text: str) -> int | None:
    try:
        value = int(text)
    except ValueError:
        return None
    return value if value > 0 else None


_NO_QUOTA = CpuQuota(0, 1, "")  # a readable file that says "no limit"; then no other file is consulted


def _cgroup_v2_quota(files: CgroupFiles, read: ReadText) -> CpuQuota | None:
    content = read(files.cpu_max)
    if content is None:
        return None
    parts = content.split()
    if len(parts) == 2 and parts[0] == "max" and _positive_int(parts[1]):
        return _NO_QUOTA
    quota_us, period_us = (_positive_int(p) for p in parts) if len(parts) == 2 else (None, None)
    if quota_us is None or period_us is None:
        log.warning("ignoring %s: expected '<quota> <period>' or 'max <period>', got %r", files.cpu_max, content)
        return None
    return CpuQuota(quota_us, period_us, str(files.cpu_max))


def _cgroup_v1_quota(files: CgroupFiles, read: ReadText) -> CpuQuota | None:
    quota_text, period_text = read(files.cfs_quota_us), read(files.cfs_period_us)
    if quota_text is None or period_text is None:
        return None
    if quota_text.strip() == "-1":
        return None  # the group has no quota
    quota_us, period_us = _positive_int(quota_text.strip()), _positive_int(period_text.strip())
    if quota_us is None or period_us is None:
        log.warning("ignoring %s / %s: expected a positive quota (or -1) and a positive period, got %r / %r",
                    files.cfs_quota_us, files.cfs_period_us, quota_text, period_text)
        return None
    return CpuQuota(quota_us, period_us, f"{files.cfs_quota_us} / {files.cfs_period_us}")


def cgroup_cpu_quota(files: CgroupFiles = CgroupFiles(), read: ReadText = read_text) -> CpuQuota | None:
    """The CPU quota of this process's cgroup (v2 first, then v1), or None when there is none."""
    quota = _cgroup_v2_quota(files, read) or _cgroup_v1_quota(files, read)
    return None if quota is _NO_QUOTA else quota


def _omp_num_threads(environ: Mapping[str, str]) -> int | None:
    raw = environ.get("OMP_NUM_THREADS")
    if raw is None or raw.strip() == "":
        return None
    value = _positive_int(raw.strip())
    if value is None:
        # OpenMP also accepts nested lists ("4,2"); a worker only uses the outer level.
        value = _positive_int(raw.split(",")[0].strip())
    if value is None:
        log.warning("ignoring OMP_NUM_THREADS=%r: expected a positive integer", raw)
    return value


def decide_num_threads(
    requested: int,
    num_affinity_cpus: int,
    environ: Mapping[str, str] | None = None,
    levels: Sequence[CgroupFiles] = (CgroupFiles(),),
    read: ReadText = read_text,
) -> ThreadDecision:
    """The worker's thread count. `requested` > 0 is an explicit count (0: decide);
    `num_affinity_cpus` is len(os.sched_getaffinity(0)); `levels` the cgroup levels whose quotas
    apply (`cgroup_levels`): the smallest quota among them counts."""
    if requested < 0:
        raise ValueError(f"requested threads must be >= 0 (0: from the CPU allocation), got {requested}")
    if num_affinity_cpus < 1:
        raise ValueError(f"num_affinity_cpus must be >= 1, got {num_affinity_cpus}")
    if requested > 0:
        return ThreadDecision(requested, ThreadSource.FLAG, f"num_threads={requested}")
    omp = _omp_num_threads(environ or {})
    if omp is not None:
        return ThreadDecision(omp, ThreadSource.OMP_ENV, f"OMP_NUM_THREADS={omp}")
    quotas = [q for q in (cgroup_cpu_quota(files, read) for files in levels) if q is not None]
    quota = min(quotas, key=lambda q: q.num_cpus, default=None)
    if quota is not None:
        # A fractional quota (1.5 CPUs) still gets its partial CPU's thread; more threads than the
        # CPUs we may run on would only time-slice.
        num_threads = max(1, min(math.ceil(quota.num_cpus), num_affinity_cpus))
        detail = (f"{quota.origin}: {quota.quota_us} us per {quota.period_us} us = {quota.num_cpus:g} CPUs, "
                  f"{num_affinity_cpus} CPUs in affinity")
        return ThreadDecision(num_threads, ThreadSource.CGROUP, detail)
    return ThreadDecision(num_affinity_cpus, ThreadSource.AFFINITY, f"{num_affinity_cpus} CPUs in affinity, no quota")
