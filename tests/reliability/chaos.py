"""The chaos driver (issue 35): the faults that each lose nothing alone, close together, under open-loop load.

One run: two schedulers, two workers of each model, two gateways (a client over both, configured as
docs/operations.md says: round_robin, the retry policy, client-side health checking, streams
re-sent when a gateway dies under them), the quota store; 80 classify/s and 3 streams/s. On a
seeded timeline (each fault's time jittered by up to `JITTER_S`, the victims drawn by the seed):

  * SIGKILL one worker of each model, each restarted 8 s later;
  * SIGKILL the scheduler serving classify, restarted 4 s later;
  * 6 s after that restart, SIGSTOP the other scheduler for 5 s;
  * SIGKILL the quota store, restarted 4 s later;
  * a rolling SIGTERM of both gateways, each restarted before the next is stopped.

It counts classify lost, streams lost and stream texts that differ from the unbroken reference,
and times the restarted scheduler from its process start to its first worker attached and to its
first served request (any model, and each model's own; p50 and max over the runs, also from SERVING). `make chaos` runs it 5 times in a row (`python -m tests.reliability.chaos`);
tests/reliability/test_chaos.py runs it once.

Each run also prints the restarted scheduler's timeline from its services' logs (`restart_timeline`):
when it listened, when its first classifier and generator workers attached, and when each gateway's
pressure poll first reached it again. A gateway routes nothing to it before that poll, and its channel
re-dials on gRPC's reconnect backoff (up to 250 ms between tries, jittered: upstream/clients.py), so
"first served" carries that backoff's phase as well as the process's start-up.

Every lost call is printed grouped by its status and message, counted (`lost_report`), and a run
with a loss keeps its services' logs (every process's, restarts included, and the store's) in
`--keep-dir` (printed), with the log lines that look like a fault (`log_findings`): a loss can be
diagnosed after the fact. `--client-resends off` runs the same with the client's own resends off (no
gRPC retries, no stream re-sent), so the gateways alone must keep every call.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tools.testbed.mesh_load import LoadCounts, LoadShape
from tools.testbed.mesh_replicas import MODELS, ReplicatedMesh, replicated_mesh
from tools.testbed.processes import ServiceProcess, wait_until
from tools.testbed.valkey import ValkeyProcess

SHAPE = LoadShape(classify_per_s=80, streams_per_s=3, classify_deadline_s=3.0, stream_deadline_s=40.0,
                  client_resumes_streams=True, client_health_check=True)
JITTER_S = 1.0
WORKER_DOWN_S = 8.0
SCHEDULER_DOWN_S = 4.0
HANG_AFTER_RESTART_S = 6.0
HANG_S = 5.0
STORE_DOWN_S = 4.0
# When each fault starts, seconds into the load (before jitter).
WORKER_KILL_AT_S = 4.0
SCHEDULER_KILL_AT_S = 5.0
STORE_KILL_AT_S = 9.0
GATEWAY_ROLL_AT_S = 22.0


@dataclass
class ChaosResult:
    seed: int
    counts: LoadCounts
    # The restarted scheduler, from its process start: SERVING, first worker attached, first request served.
    restart_to_serving_s: float | None = None
    restart_to_attached_s: float | None = None
    restart_to_served_s: float | None = None
    # The same, per model (from its start): a classifier worker attaches to every scheduler, a
    # generator worker to one at a time, so each model's first request there comes at its own time.
    restart_to_served_by_model_s: dict[str, float] = field(default_factory=dict)
    # The restarted scheduler's timeline from its services' logs, seconds from its start (restart_timeline).
    restart_timeline: dict[str, float] = field(default_factory=dict)
    # Calls the gateways held while no scheduler could take them (infermesh_gateway_held_calls_total).
    num_held: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def serving_to_served_s(self) -> float | None:
        """From the restarted scheduler's SERVING to its first served request."""
        if self.restart_to_served_s is None or self.restart_to_serving_s is None:
            return None
        return self.restart_to_served_s - self.restart_to_serving_s

    def line(self) -> str:
        c = self.counts
        return (f"seed {self.seed}: classify lost {len(c.failed_classify)} / {c.num_classify}, streams lost "
                f"{len(c.failed_streams)} / {c.num_greedy_streams + c.num_sampled_streams}, stream text mismatched "
                f"{len(c.wrong_text)}, bad indices {len(c.bad_indices)}; restarted scheduler: SERVING "
                f"{_s(self.restart_to_serving_s)}, first worker {_s(self.restart_to_attached_s)}, first served "
                f"{_s(self.restart_to_served_s)} after its start ("
                + ", ".join(f"{m} {_s(self.restart_to_served_by_model_s.get(m))}" for m in MODELS) + ")"
                + "; timeline: " + (", ".join(f"{what} {at_s:.2f}" for what, at_s in self.restart_timeline.items())
                                    or "n/a")
                + f"; held by the gateways {self.num_held:g}"
                + f"; sent again after an overload refusal {c.num_overload_retries}"
                + (f"; by code {dict(c.failure_codes)}" if c.failure_codes else ""))


_AFTER_TOKENS = re.compile(r" after \d+ tokens$")
_NUMBER = re.compile(r"\d+(\.\d+)?")


def _status(line: str) -> str:
    """A failed call's status and message: its line is "<name>, failed <time>: <status> <details>[ after N
    tokens]" (tools/testbed/mesh_load.py)."""
    return _AFTER_TOKENS.sub("", line.split(": ", 1)[-1])


def lost_groups(counts: LoadCounts) -> Counter[tuple[str, str]]:
    """Lost calls by kind and status with message, its numbers as # (a limit or a retry hint differs
    from call to call): ("classify", "RESOURCE_EXHAUSTED overloaded: ... has # requests in flight ...")."""
    groups: Counter[tuple[str, str]] = Counter()
    for kind, lines in (("classify", counts.failed_classify), ("stream", counts.failed_streams)):
        for line in lines:
            groups[kind, _NUMBER.sub("#", _status(line))] += 1
    return groups


def lost_report(counts: LoadCounts, num_examples: int = 2) -> str:
    """Every lost call's status and message, grouped and counted (most first), with a few calls of each
    in full (their send time, to match the services' logs; a stream's tokens read before it failed)."""
    lines = []
    for (kind, status), num in lost_groups(counts).most_common():
        lines.append(f"  {num} {kind}: {status}")
        failed = counts.failed_classify if kind == "classify" else counts.failed_streams
        examples = [line for line in failed if _NUMBER.sub("#", _status(line)) == status]
        lines.extend(f"      e.g. {line}" for line in examples[:num_examples])
    for what, problems in (("text mismatched", counts.wrong_text), ("bad indices", counts.bad_indices)):
        lines.extend(f"  {what}: {line[:300]}" for line in problems[:num_examples])
    return "\n".join(lines)


# Log lines that tell of a fault in a service (not the faults the driver makes on purpose).
_FINDING = re.compile(r"Traceback|Exception|Error|INTERNAL|UNKNOWN|CRITICAL|\bERROR\b")
# ... but what a killed or stopped peer causes: a connect refused, a ping timed out.
_EXPECTED = re.compile(r"Connection refused|ping_timeout|keepalive watchdog")


def log_findings(log_dir: Path, num_per_file: int = 5) -> str:
    """Per log file in `log_dir`: how many lines look like a fault, and the first few."""
    lines = []
    for path in sorted(log_dir.glob("*.log")):
        found = [line for line in path.read_text(errors="replace").splitlines()
                 if _FINDING.search(line) and not _EXPECTED.search(line)]
        if found:
            lines.append(f"  {path.name}: {len(found)} lines, e.g.")
            lines.extend(f"      {line[:300]}" for line in found[:num_per_file])
    return "\n".join(lines)


def _summary(what: str, figures: list[float | None]) -> None:
    known = sorted(f for f in figures if f is not None)
    if known:
        print(f"{what}: p50 {statistics.median(known):.2f} s, max {known[-1]:.2f} s over {len(known)} runs "
              f"({', '.join(f'{f:.2f}' for f in figures if f is not None)})")


_LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"  # services/common/log_context.py's asctime


def _log_time(line: str) -> float | None:
    try:
        return datetime.strptime(line[:23], _LOG_TIME_FORMAT).timestamp()
    except ValueError:
        return None


def restart_timeline(restarted: ServiceProcess, started_at: float) -> dict[str, float]:
    """The restarted scheduler's first moments, seconds from its process start (`started_at`, wall
    clock), from the logs in its log's folder: when it listened ("listening"), its first classifier and
    generator workers attached ("<model> attached"), and each gateway's pressure poll first reached it
    ("<gateway log> polled"). A line with no time (e.g. a traceback's) is skipped."""
    timeline: dict[str, float] = {}

    def first(what: str, path: Path, matches: Callable[[str], bool]) -> None:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            at = _log_time(line)
            if at is not None and at >= started_at and matches(line):
                timeline[what] = at - started_at
                return

    first("listening", restarted.log_path, lambda line: f"listening on {restarted.address}" in line)
    for model in MODELS:
        first(f"{model} attached", restarted.log_path, lambda line, model=model: f"attached for {model}:" in line)
    for path in sorted(restarted.log_path.parent.glob("gateway*.log")):
        first(f"{path.stem} polled", path,
              lambda line: f"scheduler {restarted.address} answers pressure polls again" in line)
    return dict(sorted(timeline.items(), key=lambda item: item[1]))


def _s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _requests(mesh: ReplicatedMesh, scheduler: ServiceProcess, **labels: str) -> float:
    try:
        return mesh.metric(scheduler, "infermesh_scheduler_requests_total", **labels)
    except Exception:  # noqa: BLE001 - not answering yet
        return 0.0


def _held(mesh: ReplicatedMesh, gateway: ServiceProcess) -> float:
    try:
        return mesh.metric(gateway, "infermesh_gateway_held_calls_total", result="held")
    except Exception:  # noqa: BLE001 - not answering: its count is lost with it
        return 0.0


class _Timeline:
    """Runs each fault on its own thread at its time; join() waits for all of them."""

    def __init__(self, began_s: float) -> None:
        self._began_s = began_s
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []

    def at(self, at_s: float, name: str, action: Callable[[], None]) -> None:
        def run() -> None:
            time.sleep(max(0.0, self._began_s + at_s - time.monotonic()))
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - reported with the run, never hidden
                self.errors.append(f"{name}: {exc!r}")

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def now(self, name: str, action: Callable[[], None]) -> None:
        self.at(time.monotonic() - self._began_s, name, action)

    def join(self) -> None:
        for thread in self._threads:
            thread.join()


def run_once(workdir: Path, seed: int, shape: LoadShape = SHAPE) -> ChaosResult:
    rng = random.Random(seed)

    def jitter(at_s: float) -> float:
        return at_s + rng.uniform(-JITTER_S, JITTER_S)

    store = ValkeyProcess(workdir).start()
    try:
        with replicated_mesh(workdir) as mesh:
            mesh.add_schedulers(2)
            mesh.add_workers(MODELS)
            for _ in range(2):
                mesh.add_gateway("--quota-store-address", store.address, "--drain-grace-s", "8",
                                 "--drain-notice-ms", "1000")
            mesh.wait_spread(MODELS)
            load = mesh.start_load(shape)
            load.wait_completed(40, "before the faults")
            result = ChaosResult(seed, LoadCounts())
            # The restarted scheduler, its start and its predecessor's kill (wall clock).
            restarts: list[tuple[ServiceProcess, float, float]] = []
            timeline = _Timeline(time.monotonic())
            killed_workers = [rng.choice([w for w in mesh.workers if model in w.name]) for model in MODELS]
            victim = mesh.scheduler_serving("toy-classifier")
            other = next(s for s in mesh.schedulers if s is not victim)

            def kill_worker(worker: ServiceProcess) -> None:
                worker.signal(signal.SIGKILL)
                worker.proc.wait(timeout=10)
                time.sleep(WORKER_DOWN_S)  # the fault lasts this long
                mesh.restart(worker)

            def kill_scheduler() -> None:
                killed_wall = time.time()
                victim.signal(signal.SIGKILL)
                victim.proc.wait(timeout=10)
                time.sleep(SCHEDULER_DOWN_S)
                began, began_wall = time.monotonic(), time.time()
                restarted = mesh.restart(victim)
                result.restart_to_serving_s = time.monotonic() - began
                restarts.append((restarted, began_wall, killed_wall))
                timeline.now("first served per model", lambda: time_first_served(restarted, began))
                wait_until(lambda: any(mesh.num_workers(restarted, m) for m in MODELS), timeout_s=30, interval_s=0.02,
                           message="a worker on the restarted scheduler")
                result.restart_to_attached_s = time.monotonic() - began
                wait_until(lambda: _requests(mesh, restarted) > 0, timeout_s=30, interval_s=0.05,
                           message="a request served by the restarted scheduler")
                result.restart_to_served_s = time.monotonic() - began
                time.sleep(max(0.0, began + HANG_AFTER_RESTART_S - time.monotonic()))
                other.signal(signal.SIGSTOP)
                try:
                    time.sleep(HANG_S)
                finally:
                    other.signal(signal.SIGCONT)

            def time_first_served(restarted: ServiceProcess, began: float) -> None:
                waiting = set(MODELS)
                while waiting and time.monotonic() - began < 30:
                    for model in [m for m in waiting if _requests(mesh, restarted, model=m) > 0]:
                        result.restart_to_served_by_model_s[model] = time.monotonic() - began
                        waiting.discard(model)
                    time.sleep(0.05)

            def kill_store() -> None:
                store.kill()
                time.sleep(STORE_DOWN_S)
                store.start()

            def roll_gateways() -> None:
                for index in range(len(mesh.gateways)):
                    old = mesh.gateways[index]
                    result.num_held += _held(mesh, old)
                    old.signal(signal.SIGTERM)
                    old.proc.wait(timeout=30)
                    new = mesh.restart(old)
                    wait_until(lambda new=new: mesh.metric(new, "infermesh_gateway_requests_total") >= 20,
                               timeout_s=30, message="the restarted gateway serving")

            for worker in killed_workers:
                timeline.at(jitter(WORKER_KILL_AT_S), f"kill {worker.name}", lambda worker=worker: kill_worker(worker))
            timeline.at(jitter(SCHEDULER_KILL_AT_S), f"kill {victim.name}", kill_scheduler)
            timeline.at(jitter(STORE_KILL_AT_S), "kill the store", kill_store)
            timeline.at(jitter(GATEWAY_ROLL_AT_S), "roll the gateways", roll_gateways)
            timeline.join()
            load.wait_completed(80, "after the faults")
            result.counts = load.stop()
            result.num_held += sum(_held(mesh, gateway) for gateway in mesh.gateways)
            result.notes.extend(timeline.errors)
            for restarted, began_wall, killed_wall in restarts:
                result.restart_timeline = {"killed": killed_wall - began_wall,
                                           **restart_timeline(restarted, began_wall)}
            return result
    finally:
        store.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs in a row (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=35, help="seed of the first run; run i uses seed + i")
    parser.add_argument("--keep-dir", type=Path, default=Path(tempfile.gettempdir()),
                        help="where a run with a loss keeps its services' logs (default: %(default)s)")
    parser.add_argument("--keep-all", action="store_true", help="keep every run's logs, not only a lossy run's")
    parser.add_argument("--client-resends", choices=("on", "off"), default="on",
                        help="on: the documented client (gRPC retries of UNAVAILABLE, streams re-sent when a gateway "
                        "dies); off: neither, so every call the gateways fail is counted (default: %(default)s)")
    args = parser.parse_args(argv)
    shape = SHAPE if args.client_resends == "on" else dataclasses.replace(
        SHAPE, client_resumes_streams=False, client_retries=False)
    args.keep_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(args.runs):
        seed = args.seed + i
        workdir = Path(tempfile.mkdtemp(prefix=f"infermesh-chaos-seed{seed}-", dir=args.keep_dir))
        try:
            result = run_once(workdir, seed, shape)
        except BaseException:
            print(f"run {i + 1}: seed {seed} did not finish; its logs: {workdir}", flush=True)
            raise
        results.append(result)
        print(f"run {i + 1}: {result.line()}" + "".join(f"\n  fault error: {n}" for n in result.notes), flush=True)
        lossy = sum(result.counts.problems().values()) + len(result.notes) > 0
        if lossy:
            print(f"  lost, by status and message:\n{lost_report(result.counts)}")
            findings = log_findings(workdir)
            print(f"  logs kept in {workdir}" + (f"; lines that look like faults:\n{findings}" if findings else ""))
        elif args.keep_all:
            print(f"  logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        sys.stdout.flush()
    _summary("restart to first served (from its start)", [r.restart_to_served_s for r in results])
    _summary("restart to first served (from SERVING)", [r.serving_to_served_s for r in results])
    for model in MODELS:
        _summary(f"restart to first {model} served (from its start)",
                 [r.restart_to_served_by_model_s.get(model) for r in results])
    lost = sum(sum(r.counts.problems().values()) + len(r.notes) for r in results)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
