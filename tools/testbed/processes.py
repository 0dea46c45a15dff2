"""Real service processes on 127.0.0.1 with free ports, for tests and benchmarks.

Each process is started by the test and stopped by its PID (SIGTERM, then SIGKILL);
nothing is left behind even when a test fails.

Every process talks TLS by default, with the test session's dev CA (tools/testbed/session_tls.py):
mTLS at the scheduler and workers, server TLS on the gateway's public port. Tests reach a process
with `process.channel()` (or session_tls.channel(address)); a test about plaintext starts its
processes with tls=False. /metrics stays plain HTTP in tests (--metrics-tls false): scrapes are
the test's own, and HTTPS metrics are tested once, in test_tls_gateway.py.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tools.testbed import fork_server, session_tls

ROOT = Path(__file__).resolve().parents[2]


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 nothing listens on, for a process the test starts.

    Not from bind(0): that draws from the kernel's ephemeral range, which every outgoing connection
    also draws its source port from, so a client socket could take the port between this call and
    the service's bind (CI saw "Address already in use" on a worker's metrics port). Ports below
    that range are only ever taken by explicit binds; none is handed out twice per test session, and
    pytest-xdist's workers draw from disjoint slices of it: a port handed out by one worker is free to
    bind until its service starts, seconds later on a loaded box, so another worker's bind check could
    not see it (a scheduler died on "Address already in use" on its metrics port in a -n 3 run).
    """
    first, end = _port_slice(max(1024, _ephemeral_low() - 12000), _ephemeral_low())
    for _ in range(1000):
        port = random.randrange(first, end)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in [{first}, {end}) on 127.0.0.1")


def _port_slice(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's share of [low, high) (all of it outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or not worker[2:].isdigit() or count <= 1:
        return low, high
    index = int(worker[2:]) % count
    size = (high - low) // count
    return low + index * size, low + (index + 1) * size


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health_status(address: str, timeout_s: float = 1.0, *, tls: bool = True) -> int | None:
    """The overall grpc.health.v1 status of a test's process (over the session's mTLS unless tls is
    False), or None when it does not answer."""
    try:
        with session_tls.channel(address, tls=tls) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s).status
    except grpc.RpcError:
        return None


# The last line services/common/server.py logs, its shutdown done (the text log format).
STOPPED_LINE = b" services.common.server: stopped\n"
STOP_POLL_S = 0.02
# Environment every gateway started here gets unless the caller's environment or the process's own `env` sets
# the variable (and a flag wins over both). Empty for benchmarks; the test suite sets its defaults
# (tests/conftest.py).
GATEWAY_ENV_DEFAULTS: dict[str, str] = {}
# Fork services from a warm interpreter (tools/testbed/fork_server.py) instead of starting them cold: the test
# suite turns it on (tests/conftest.py); benchmarks keep plain Popen.
FORK_SERVER = False


@dataclass
class ServiceProcess:
    name: str
    service: str  # gateway | scheduler | worker
    port: int
    args: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | fork_server.ForkedProcess | None = None
    # Prepended to the command line, e.g. ("ip", "netns", "exec", "ns") to run it in a network namespace.
    launcher: tuple[str, ...] = ()
    # The interpreter (another environment's python, e.g. one built from a service's requirements set).
    python: str = sys.executable
    # TLS with the session's dev CA (flags before args, so a test's own --tls-* flags win); False: plaintext.
    tls: bool = True
    # The module run with -m; "" runs services.<service> (a benchmark may run its own baseline).
    module: str = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def probe_address(self) -> str:
        """Where the test itself reaches the process (its health probe); the same as address here."""
        return self.address

    def tls_args(self) -> list[str]:
        if not self.tls:
            own_files = "--tls-cert-file" in self.args or any(k.endswith("_TLS_CERT_FILE") for k in self.env)
            return [] if own_files else ["--plaintext"]
        return [*session_tls.session_pki().server_args(self.service), "--metrics-tls", "false"]

    def anonymous_args(self) -> list[str]:
        """A test gateway with no tenants file admits everyone: the gateway refuses that unless told."""
        if self.service != "gateway" or "--tenants-file" in self.args or "INFERMESH_GATEWAY_TENANTS_FILE" in self.env:
            return []
        return ["--allow-anonymous"]

    def channel(self, identity: str | None = "gateway", **options) -> grpc.Channel:
        """A channel to this process as the test reaches it: mTLS as `identity` (the gateway's certificate
        by default: the scheduler serves requests only to it), plaintext for a tls=False process."""
        return session_tls.channel(self.probe_address, identity, tls=self.tls, **options)

    def aio_channel(self, identity: str | None = "gateway", **options) -> grpc.aio.Channel:
        return session_tls.aio_channel(self.probe_address, identity, tls=self.tls, **options)

    def start(self) -> ServiceProcess:
        # A test gateway stops at once on SIGTERM (its teardown): the drain notice (1 s by default) is
        # for clients watching its health, which only the tests of a roll have; they set it.
        notice = {"INFERMESH_GATEWAY_DRAIN_NOTICE_MS": "0"} if self.service == "gateway" else {}
        defaults = GATEWAY_ENV_DEFAULTS if self.service == "gateway" else {}
        env = {**defaults, **os.environ, **notice, **self.env, "PYTHONUNBUFFERED": "1"}
        module = self.module or f"services.{self.service}"
        args = ["--port", str(self.port), *self.tls_args(), *self.anonymous_args(), *self.args]
        if FORK_SERVER and not self.launcher and self.python == sys.executable and fork_server.available():
            self.proc = fork_server.spawn(self.service, module, args, env, ROOT, self.log_path)
            return self
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process for its lifetime
        self.proc = subprocess.Popen([*self.launcher, self.python, "-m", module, *args],
                                     cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if health_status(self.probe_address, tls=self.tls) == SERVING:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not SERVING after {timeout_s}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, and the process's whole shutdown (drain, server stop, service close) until it logs
        its last line, "stopped" (services/common/server.py); then SIGKILL if it has not exited yet.
        What is left then is the interpreter's finalization, which no test observes: its final garbage
        collection over torch's and transformers' objects took a model worker 0.6-1.8 s of CPU after
        "stopped". A process that never logs it (its log level above INFO) is waited for until it exits.
        SIGKILL after `timeout_s` in any case. Tests that look at an exit code signal and wait themselves."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            logged_before = self._log_size()
            self.proc.send_signal(signal.SIGTERM)
            give_up = time.monotonic() + timeout_s
            while not self._exited_within(STOP_POLL_S):
                if self._logged_stopped(logged_before) or time.monotonic() > give_up:
                    self.proc.kill()
                    self.proc.wait(timeout=5)
                    break
        return self.proc.returncode

    def _exited_within(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def _logged_stopped(self, offset: int) -> bool:
        """Whether the log has the server's last line past `offset` (the text log format's)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(offset)
                return STOPPED_LINE in log.read()
        except FileNotFoundError:
            return False

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Mesh:
    """A scheduler, a gateway and any number of workers, all started by the test."""

    tmp: Path
    env: dict[str, str] = field(default_factory=dict)
    tls: bool = True  # every process with the session's dev CA; False: all plaintext
    processes: list[ServiceProcess] = field(default_factory=list)
    scheduler: ServiceProcess | None = None
    gateway: ServiceProcess | None = None

    def _spawn(self, name: str, service: str, args: list[str], env: dict[str, str] | None = None,
               module: str = "") -> ServiceProcess:
        process = ServiceProcess(name, service, free_port(), args, {**self.env, **(env or {})}, self.tmp / f"{name}.log",
                                 tls=self.tls, module=module)
        self.processes.append(process)
        return process.start()

    def start_scheduler(self, *args: str, env: dict[str, str] | None = None, module: str = "") -> ServiceProcess:
        """`module`: run instead of services.scheduler (the same flags), e.g. a benchmark's baseline."""
        self.scheduler = self._spawn("scheduler", "scheduler", list(args), env, module)
        self.scheduler.wait_serving()
        return self.scheduler

    def start_gateway(self, *args: str, env: dict[str, str] | None = None) -> ServiceProcess:
        self.gateway = self._spawn(
            "gateway", "gateway", ["--scheduler-address", self.scheduler.address, *args], env
        )
        self.gateway.wait_serving()
        return self.gateway

    def start_worker(self, model_name: str, *args: str, name: str | None = None, wait: bool = True,
                     env: dict[str, str] | None = None) -> ServiceProcess:
        name = name or f"worker-{model_name}-{len(self.processes)}"
        worker = self._spawn(
            name, "worker",
            ["--scheduler-address", self.scheduler.address, "--model-name", model_name,
             "--reconnect-initial-s", "0.05", "--reconnect-max-s", "0.5", *args],
            env,
        )
        if wait:
            worker.wait_serving()
        return worker

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.stop()

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in self.processes)


def wait_all_serving(processes: Iterable[ServiceProcess], timeout_s: float = 60.0) -> None:
    """Until each of `processes` is SERVING. Started together (start_worker(..., wait=False)), processes that
    load a model each load it side by side: two torch workers took 4.0 + 5.0 s one after the other."""
    for process in processes:
        process.wait_serving(timeout_s)


@contextmanager
def running_mesh(tmp: Path, env: dict[str, str] | None = None, tls: bool = True) -> Iterator[Mesh]:
    mesh = Mesh(tmp, dict(env or {}), tls=tls)
    try:
        yield mesh
    finally:
        mesh.stop_all()


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05, message: str = "condition") -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if predicate():
            return
        time.sleep(interval_s)
    raise TimeoutError(f"{message} not reached within {timeout_s}s")
