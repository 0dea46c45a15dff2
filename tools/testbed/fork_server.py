"""Service processes forked from a warm interpreter instead of started cold, for the test suite.

A service started with `python -m services.<name>` spent ~0.6 s of CPU before it served on the 2-core
box: starting an interpreter, importing grpc, protobuf, prometheus_client, cryptography, OpenTelemetry,
uvloop and then its own modules; the suite starts ~480 of them. A fork server is an interpreter per
service kind and test process that has imported all of that once (PRELOADED, then `services.<kind>.server`)
and forks each service of that kind from there. The child sets up what `python -m` and Popen would have
(environment, working directory, argv, stdout and stderr on the log, stdin from /dev/null, no other file
descriptor) and runs the module as __main__. What is imported first is what a cold start imports before
it reads its configuration: no module of ours reads the environment, the clock or the pid at import, and
each kind has its own server, so no metric of one service is registered in another. The workers' server
has torch imported too (~2 s of CPU in each model worker's start): the worker sizes torch's pools with
torch.set_num_threads after it exports its thread counts (services/worker/thread_settings.py), and numba,
whose pool is sized at import, is imported in the child.

The service must be the test process's own child, as a Popen's is: the test signals it, waits for it
and reads its exit status. The server forks twice and the middle process exits, so the service is
re-parented to the nearest ancestor that is a child subreaper; the test process is one only while it
asks for a fork (PR_SET_CHILD_SUBREAPER around the request), so processes other tools orphan meanwhile
are not adopted. `ForkedProcess` is the part of Popen the testbed and the tests use (pid, poll, wait,
returncode, send_signal, kill, terminate).

Benchmarks and `make up` keep plain Popen: tests/conftest.py turns this on for the suite
(processes.FORK_SERVER). Where it cannot work (another interpreter, a launcher such as `ip netns exec`)
a process is started with Popen as before.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import io
import json
import os
import runpy
import select
import subprocess
import sys
import threading
from pathlib import Path

# Third-party modules every service imports before it serves; the server of a kind then imports what
# KIND_PRELOADED names.
PRELOADED = (
    "asyncio", "concurrent.futures", "http.server", "json", "logging.handlers", "ssl", "uuid",
    "grpc", "grpc.aio", "grpc_health.v1.health_pb2", "grpc_health.v1.health_pb2_grpc", "grpc_health.v1._async",
    "grpc_reflection.v1alpha.reflection", "google.protobuf.json_format", "google.rpc.status_pb2",
    "prometheus_client", "uvloop", "yaml", "cryptography.x509", "cryptography.hazmat.primitives.serialization",
    "opentelemetry.propagate", "opentelemetry.sdk.resources", "opentelemetry.sdk.trace",
    "opentelemetry.sdk.trace.export",
)
KIND_PRELOADED = {
    "gateway": ("services.gateway.server",),
    "scheduler": ("services.scheduler.server",),
    "worker": ("services.worker.server", "torch"),
}
_PR_SET_CHILD_SUBREAPER = 36


# --------------------------------------------------------------------------- the server (its own process)


def serve(preload: list[str]) -> None:
    """Reads one JSON request a line on stdin, answers each with the forked service's pid (0: failed)."""
    for name in (*PRELOADED, *preload):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the child imports what it needs itself, and fails as a cold start would
    for line in sys.stdin.buffer:
        request = json.loads(line)
        sys.stdout.write(f"{_fork_twice(request)}\n")
        sys.stdout.flush()


def _fork_twice(request: dict) -> int:
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(read_end)
        service = os.fork()
        if service == 0:
            os.close(write_end)
            _become(request)  # raises SystemExit: never returns here
        os.write(write_end, str(service).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        pid = int(answer.read() or b"0")
    os.waitpid(middle, 0)  # once it is gone, the service is re-parented to the test process
    return pid


def _become(request: dict) -> None:
    """In the forked child: what `python -m <module> <args>` with Popen's defaults would have set up."""
    log = os.open(request["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Unbuffered, as PYTHONUNBUFFERED=1 (which every testbed process gets) makes a fresh interpreter's.
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                   errors="backslashreplace")
    sys.argv = [request["module"], *request["args"]]
    sys.path[0] = request["cwd"]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


# --------------------------------------------------------------------------- the client (in the test process)


class ForkedProcess:
    """A service forked by the server and adopted by this process: the subset of Popen the testbed uses."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]
        if timeout is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        # Passive: the pid's file descriptor turns readable when the process exits.
        pidfd = os.pidfd_open(self.pid)
        try:
            select.select([pidfd], [], [], timeout)
        finally:
            os.close(pidfd)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


# One fork at a time across the servers: PR_SET_CHILD_SUBREAPER is the process's, and a window closed by
# one thread while another's middle process is still exiting would leave that service to init.
_fork_lock = threading.Lock()


class _Client:
    def __init__(self, root: Path, preload: tuple[str, ...]) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._server = subprocess.Popen([sys.executable, "-m", "tools.testbed.fork_server", *preload], cwd=root,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
        request = {"module": module, "args": args, "env": env, "cwd": str(cwd), "log_path": str(log_path)}
        with _fork_lock:
            self._subreaper(True)
            try:
                self._server.stdin.write(json.dumps(request).encode() + b"\n")
                self._server.stdin.flush()
                pid = int(self._server.stdout.readline() or b"0")
            finally:
                self._subreaper(False)
        if not pid:
            raise RuntimeError(f"the fork server could not start {module} (exited: {self._server.poll()})")
        return ForkedProcess(pid, [sys.executable, "-m", module, *args])

    def _subreaper(self, on: bool) -> None:
        if self._libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")

    def alive(self) -> bool:
        return self._server.poll() is None

    def close(self) -> None:
        self._server.stdin.close()  # the server ends at end of input; the services it forked go on
        self._server.wait(timeout=10)


_clients: dict[str, _Client] = {}  # by service kind
_clients_lock = threading.Lock()


@functools.cache
def available() -> bool:
    """Whether this machine lets the test process adopt forked services and wait on them: Linux, a kernel with
    pidfd_open (5.3+) and a prctl that sets the child subreaper (a sandbox's seccomp may refuse it). Asked once;
    where it answers no, services start cold with Popen as before."""
    if sys.platform != "linux" or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) == 0


def spawn(kind: str, module: str, args: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
    """`python -m module args` forked from this test process's server for `kind` (gateway, scheduler, worker),
    started on first use."""
    with _clients_lock:
        client = _clients.get(kind)
        if client is None or not client.alive():
            client = _clients[kind] = _Client(cwd, KIND_PRELOADED.get(kind, ()))
    return client.spawn(module, args, env, cwd, log_path)


def stop() -> None:
    with _clients_lock:
        for client in _clients.values():
            client.close()
        _clients.clear()


if __name__ == "__main__":
    serve(sys.argv[1:])
