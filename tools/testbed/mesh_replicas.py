"""A replicated mesh of real processes: N schedulers, M gateways, workers spread over the schedulers.

Every gateway and worker is given every scheduler address (`--scheduler-address a,b`), as
`make up` and the Kubernetes manifests do. By default everything runs on 127.0.0.1; with a
`Lan` (tools/testbed/netns.py) each process runs on the network-namespace host it is placed
on, so a test can cut one host's link instead of killing its processes.

A killed process is restarted on the same port (`restart`), so the others find it again
at the address they were given.
"""

from __future__ import annotations

import http.client
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from infermesh.v1 import common_pb2
from tools.testbed.gateway_fixtures import Metrics, scrape
from tools.testbed.mesh_load import LoadCounts, LoadShape, MeshLoad, StreamSpec
from tools.testbed.netns import HostedProcess, Lan
from tools.testbed.processes import ServiceProcess, free_port, wait_all_serving, wait_until
from tools.testbed.scheduler_fixtures import pressure_of, scheduler_stub

CLASSIFIER_ARGS = ("--toy-compute-ms", "5")
# block_size 16 and max_seq_len 512 like the toy generator; a 20 ms step on an asyncio timer.
GENERATOR_ARGS = ("--mock-profile", "step_ms=20,block_size=16,max_seq_len=512")
WORKER_ARGS = {"toy-classifier": CLASSIFIER_ARGS, "mock-generator": GENERATOR_ARGS}
# Models whose worker attaches to every scheduler it is given (services/worker/attach_every.py), not to one.
ATTACHED_TO_EVERY_SCHEDULER = frozenset({"toy-classifier", "mock-classifier"})


@dataclass
class ReplicatedMesh:
    tmp: Path
    lan: Lan | None = None
    env: dict[str, str] = field(default_factory=dict)
    schedulers: list[ServiceProcess] = field(default_factory=list)
    gateways: list[ServiceProcess] = field(default_factory=list)
    workers: list[ServiceProcess] = field(default_factory=list)
    loads: list[MeshLoad] = field(default_factory=list)

    # ------------------------------------------------------------------ starting

    def _new(self, name: str, service: str, port: int, args: list[str], host: str) -> ServiceProcess:
        log_path = self.tmp / f"{name}.log"
        if self.lan is None:
            return ServiceProcess(name, service, port, args, dict(self.env), log_path)
        return HostedProcess(name, service, port, ["--host", self.lan.ip_of(host), *args], dict(self.env),
                             log_path, launcher=self.lan.launcher(host), lan=self.lan, host=host)

    def add_schedulers(self, num: int, *args: str, hosts: list[str] | None = None) -> list[ServiceProcess]:
        """Starts `num` schedulers (on `hosts[i]` with a Lan) and waits until each serves."""
        started = []
        for i in range(num):
            metrics = ["--metrics-port", str(free_port())]
            name = f"scheduler{len(self.schedulers) + 1}"
            process = self._new(name, "scheduler", free_port(), [*metrics, *args], hosts[i] if hosts else "")
            self.schedulers.append(process.start())
            started.append(process)
        for process in started:
            process.wait_serving()
        return started

    @property
    def scheduler_addresses(self) -> str:
        return ",".join(s.address for s in self.schedulers)

    def add_gateway(self, *args: str, host: str = "") -> ServiceProcess:
        """A gateway on every scheduler, serving /metrics (see metric)."""
        name = f"gateway{len(self.gateways) + 1}"
        metrics = ["--metrics-port", str(free_port())]
        process = self._new(name, "gateway", free_port(),
                            ["--scheduler-address", self.scheduler_addresses, *metrics, *args], host)
        self.gateways.append(process.start())
        process.wait_serving()
        return process

    def add_worker(self, model_name: str, *args: str, host: str = "", wait: bool = True) -> ServiceProcess:
        name = f"worker{len(self.workers) + 1}-{model_name}"
        process = self._new(
            name, "worker", free_port(),
            ["--scheduler-address", self.scheduler_addresses, "--model-name", model_name,
             "--reconnect-initial-s", "0.05", "--reconnect-max-s", "0.5", *WORKER_ARGS.get(model_name, ()), *args],
            host,
        )
        self.workers.append(process.start())
        if wait:
            process.wait_serving()
        return process

    def add_workers(self, model_names: list[str], num_per_model: int = 2, host: str = "") -> list[ServiceProcess]:
        """`num_per_model` workers of each model, in that order, until each is SERVING. A classifier worker
        attaches to every scheduler, so those start side by side; a generator worker attaches to the
        scheduler with the fewest of its model's workers, so each starts once the one before it serves,
        and they spread over the schedulers."""
        started = [self.add_worker(model, host=host, wait=model not in ATTACHED_TO_EVERY_SCHEDULER)
                   for model in model_names for _ in range(num_per_model)]
        wait_all_serving(started)
        return started

    def start_load(self, shape: LoadShape) -> MeshLoad:
        """Load on the gateways, stopped by stop_all at the latest (so no call outlives the test)."""
        load = MeshLoad(self.gateway_target, shape).start()
        self.loads.append(load)
        return load

    def restart(self, old: ServiceProcess) -> ServiceProcess:
        """A fresh process in `old`'s place, same port and flags (old must have exited); its log is name+.log."""
        assert not old.alive(), f"{old.name} is still running"
        for group in (self.schedulers, self.gateways, self.workers):
            if old in group:
                process = self._copy(old, f"{old.name}+")
                group[group.index(old)] = process
                process.start()
                process.wait_serving()
                return process
        raise ValueError(f"{old.name} is not part of this mesh")

    def _copy(self, old: ServiceProcess, name: str) -> ServiceProcess:
        copy = ServiceProcess(name, old.service, old.port, list(old.args), dict(old.env), self.tmp / f"{name}.log",
                              launcher=old.launcher, tls=old.tls)
        if isinstance(old, HostedProcess):
            copy = HostedProcess(copy.name, copy.service, copy.port, copy.args, copy.env, copy.log_path,
                                 launcher=copy.launcher, tls=old.tls, lan=old.lan, host=old.host)
        return copy

    # ------------------------------------------------------------------ observing

    @property
    def gateway_target(self) -> str:
        """A gRPC target over every gateway (ipv4:a,b on 127.0.0.1; the first gateway's forwarder on a Lan)."""
        if self.lan is None:
            return "ipv4:" + ",".join(g.address for g in self.gateways)
        return self.gateways[0].probe_address

    def metric(self, process: ServiceProcess, name: str, **labels: str) -> float:
        """The sum of a metric's samples on a gateway or scheduler whose labels include `labels`."""
        port = int(process.args[process.args.index("--metrics-port") + 1])
        if not isinstance(process, HostedProcess):
            return scrape(port).value(name, **labels)
        return Metrics(_samples(_get_over_unix(process.lan.forward(process.host, port), "/metrics"))).value(
            name, **labels)

    def gateway_failovers(self) -> tuple[float, float]:
        """Streams resumed and calls failed over by all gateways (printed; 0 would mean nothing was tested)."""
        resumed = sum(self.metric(g, "infermesh_gateway_stream_resumes_total") for g in self.gateways if g.alive())
        failed_over = sum(self.metric(g, "infermesh_gateway_failovers_total") for g in self.gateways if g.alive())
        print(f"gateways: {resumed:g} streams resumed, {failed_over:g} calls failed over")
        return resumed, failed_over

    def scheduler_serving(self, model_name: str) -> ServiceProcess:
        """The scheduler the gateway sends `model_name` to now: the one with its calls running or done."""
        def activity(scheduler: ServiceProcess) -> float:
            return (self.metric(scheduler, "infermesh_scheduler_running_sequences", model=model_name)
                    + self.metric(scheduler, "infermesh_scheduler_requests_total", model=model_name))

        wait_until(lambda: any(activity(s) > 0 for s in self.schedulers), timeout_s=10,
                   message=f"a scheduler serving {model_name}")
        return max(self.schedulers, key=activity)

    def num_workers(self, scheduler: ServiceProcess, model_name: str) -> int:
        try:
            with scheduler_stub(scheduler.probe_address) as stub:
                pressure = pressure_of(stub, common_pb2.ModelRef(name=model_name))
        except Exception:  # noqa: BLE001 - an unreachable scheduler has no workers to count
            return 0
        return 0 if pressure is None else pressure.num_workers

    def workers_by_scheduler(self, model_name: str) -> list[int]:
        return [self.num_workers(s, model_name) for s in self.schedulers]

    def wait_spread(self, model_names: list[str], timeout_s: float = 30.0) -> None:
        """Until every scheduler has at least one worker of each model (workers spread over them)."""
        def spread() -> bool:
            return all(min(self.workers_by_scheduler(m)) >= 1 for m in model_names)

        wait_until(spread, timeout_s=timeout_s, interval_s=0.2,
                   message=f"workers of {model_names} on every scheduler")

    def wait_attached(self, model_names: list[str], num_per_model: int, timeout_s: float = 20.0) -> None:
        """Until `num_per_model` workers of each model are attached, to whichever schedulers (at least:
        a classifier worker attaches to every scheduler, so it counts once per scheduler)."""
        def attached() -> bool:
            return all(sum(self.workers_by_scheduler(m)) >= num_per_model for m in model_names)

        wait_until(attached, timeout_s=timeout_s, interval_s=0.2,
                   message=f"{num_per_model} workers of each of {model_names} attached")

    def processes(self) -> list[ServiceProcess]:
        return [*self.gateways, *self.workers, *self.schedulers]

    def logs(self, num_lines: int = 30) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail(num_lines)}" for p in self.processes())

    def stop_all(self) -> None:
        # The load first, then gateways (no new calls), then workers, then schedulers: a scheduler
        # stopped before its workers would wait out its drain grace for them.
        for load in self.loads:
            load.stop(timeout_s=45)
        for process in self.processes():
            process.stop()


# What the reliability tests run: the toy classifier and the mock generator, two workers each.
MODELS = ["toy-classifier", "mock-generator"]
SHAPE = LoadShape(classify_per_s=60, streams_per_s=4)


def start_spread_mesh(mesh: ReplicatedMesh, num_gateways: int = 1) -> None:
    """Two schedulers, gateways on both, two workers per model with one of each on each scheduler."""
    mesh.add_schedulers(2)
    mesh.add_workers(MODELS)
    for _ in range(num_gateways):
        mesh.add_gateway()
    mesh.wait_spread(MODELS)


def kill(victim: ServiceProcess, load: MeshLoad) -> None:
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=10)
    load.wait_completed(150, f"after the SIGKILL of {victim.name}")


def kill_and_restart(mesh: ReplicatedMesh, victim: ServiceProcess, load: MeshLoad) -> None:
    kill(victim, load)
    mesh.restart(victim)
    mesh.wait_attached(MODELS, 2)
    load.wait_completed(60, f"after the restart of {victim.name}")


# The partition tests' hosts: a scheduler each on s1 and s2, the gateway on gw, every worker on wk.
PARTITION_HOSTS = ["s1", "s2", "gw", "wk"]
CUT_S = 4.0
# Long streams (longer than the cut) too, so that some still run when the link returns.
PARTITION_STREAMS = (StreamSpec("abc", 80), StreamSpec("mesh", 80, seed=12345),
                     StreamSpec("hello", 400), StreamSpec("xyz", 400, seed=99))


def cut_scheduler_under_load(tmp_path, network: Lan, model: str, shape: LoadShape) -> LoadCounts:
    """Cuts the link of the scheduler serving `model` mid-load for CUT_S, then requires nothing lost."""
    with replicated_mesh(tmp_path, lan=network) as mesh:
        mesh.add_schedulers(2, hosts=PARTITION_HOSTS[:2])
        mesh.add_workers(MODELS, host=PARTITION_HOSTS[3])
        mesh.add_gateway(host=PARTITION_HOSTS[2])
        mesh.wait_spread(MODELS)

        load = mesh.start_load(shape)
        load.wait_completed(20, "before the cut")
        victim = mesh.scheduler_serving(model)
        network.cut(victim.host)
        done_at_cut = load.num_done
        time.sleep(CUT_S)  # the partition lasts this long whatever happens meanwhile
        done_during_cut = load.num_done - done_at_cut
        network.restore(victim.host)
        load.wait_completed(20, "after the restore")
        counts = load.stop()  # waits for every call sent, so chunks the cut-off scheduler held arrive first

        mesh.gateway_failovers()
        counts.assert_nothing_lost(
            f"link of the scheduler serving {model} cut {CUT_S:g} s ({done_during_cut} calls done meanwhile)",
            mesh.logs, min_classify=100 if shape.classify_per_s else 0)
        return counts


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket: a service's /metrics inside a network namespace, through its forwarder."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _get_over_unix(target: str, path: str) -> str:
    connection = _UnixHTTPConnection(target.removeprefix("unix:"))
    try:
        connection.request("GET", path)
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@contextmanager
def replicated_mesh(tmp: Path, lan: Lan | None = None, env: dict[str, str] | None = None) -> Iterator[ReplicatedMesh]:
    mesh = ReplicatedMesh(tmp, lan, dict(env or {}))
    try:
        yield mesh
    finally:
        mesh.stop_all()
