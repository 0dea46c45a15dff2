"""Test hosts in Linux network namespaces, joined by veth pairs to a bridge, for partition tests.

    <prefix>-hub:   bridge br0 (a switch, no address)
    <prefix>-<h>:   eth0 = 10.213.77.N/24, its peer v-<h> a port of br0 in the hub

Every link is created inside the namespaces (`ip -n`), never in the root namespace, and
the addresses are used only there, so nothing is routed to or from the machine's own
network. Cutting a host is `ip link set v-<h> down` in the hub: the host stays alive but
no packet reaches it or leaves it, the case a kill never shows. Closing the Lan deletes
the namespaces, which deletes their links; the unix forwarders that let the test process
reach services inside (tools/testbed/unix_forward.py) are stopped by PID first.

Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2; `netns_unavailable()` says why not.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tools.testbed.processes import ROOT, ServiceProcess

SUBNET = "10.213.77"  # a private range, used only inside the namespaces this module creates


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"improbe{os.getpid()}"
    created = _ip("netns", "add", probe)
    if created.returncode != 0:
        return f"`ip netns add` is not permitted: {created.stderr.strip()}"
    veth = _ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
    _ip("netns", "del", probe)
    if veth.returncode != 0:
        return f"cannot create veth pairs in a namespace: {veth.stderr.strip()}"
    return None


@dataclass
class Lan:
    """Hosts on one switch; create with `lan(...)` so every namespace is removed afterwards."""

    prefix: str
    host_names: tuple[str, ...]
    sock_dir: Path  # short path: a Unix socket path must fit in 108 bytes
    forwarders: dict[tuple[str, int], subprocess.Popen] = field(default_factory=dict)

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def ip_of(self, host: str) -> str:
        return f"{SUBNET}.{self.host_names.index(host) + 1}"

    def launcher(self, host: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.namespace(host))

    def _run(self, *args: str) -> None:
        done = _ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")

    def create(self) -> None:
        self._run("netns", "add", self.hub)
        self._run("-n", self.hub, "link", "add", "br0", "type", "bridge")
        self._run("-n", self.hub, "link", "set", "br0", "up")
        for host in self.host_names:
            ns, port = self.namespace(host), self._hub_port(host)
            self._run("netns", "add", ns)
            self._run("-n", ns, "link", "set", "lo", "up")
            self._run("-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._run("-n", self.hub, "link", "set", port, "master", "br0")
            self._run("-n", self.hub, "link", "set", port, "up")
            self._run("-n", ns, "addr", "add", f"{self.ip_of(host)}/24", "dev", "eth0")
            self._run("-n", ns, "link", "set", "eth0", "up")

    def _hub_port(self, host: str) -> str:
        return f"v-{host}"[:15]

    def cut(self, host: str) -> None:
        """No packet reaches the host or leaves it until restore(); its processes keep running."""
        self._run("-n", self.hub, "link", "set", self._hub_port(host), "down")

    def restore(self, host: str) -> None:
        self._run("-n", self.hub, "link", "set", self._hub_port(host), "up")

    def forward(self, host: str, port: int) -> str:
        """A unix: target through which the test reaches host:port (one forwarder per pair)."""
        path = self.sock_dir / f"{host}-{port}.sock"
        if (host, port) not in self.forwarders:
            self.forwarders[(host, port)] = subprocess.Popen(
                [*self.launcher(host), sys.executable, "-m", "tools.testbed.unix_forward",
                 "--listen", str(path), "--to", f"{self.ip_of(host)}:{port}"],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            give_up = time.monotonic() + 10
            # The socket file appears at bind(), before listen(): a connect in between is refused
            # (CI under load once failed a scrape so). Ready means a connect succeeds.
            while not _accepts(path):
                if time.monotonic() > give_up:
                    raise TimeoutError(f"forwarder to {host}:{port} did not listen on {path}")
                time.sleep(0.02)
        return f"unix:{path}"

    def close(self) -> None:
        for proc in self.forwarders.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.forwarders.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        for host in self.host_names:
            _ip("netns", "del", self.namespace(host))
        _ip("netns", "del", self.hub)
        shutil.rmtree(self.sock_dir, ignore_errors=True)


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
    return True


def remove_orphans() -> list[str]:
    """Deletes namespaces this module made for a test process that no longer runs (one killed before
    its finalizers ran); a live process's namespaces are left alone. Returns the names deleted."""
    listed = _ip("netns", "list").stdout.split()
    orphans = [name for name in listed if (match := _OURS.match(name)) and not _pid_alive(int(match[1]))]
    for name in orphans:
        _ip("netns", "del", name)
    return orphans


_OURS = re.compile(r"^im(\d+)-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def lan(host_names: list[str], prefix: str | None = None) -> Iterator[Lan]:
    """Namespaces for `host_names` on one switch, all deleted on exit, even after a failure."""
    remove_orphans()
    network = Lan(prefix or f"im{os.getpid()}", tuple(host_names), Path(tempfile.mkdtemp(prefix="imn")))
    try:
        network.create()
        yield network
    finally:
        network.close()


@dataclass
class HostedProcess(ServiceProcess):
    """A service process on one Lan host: bound to the host's address, probed through a forwarder."""

    lan: Lan | None = None
    host: str = ""

    @property
    def address(self) -> str:
        return f"{self.lan.ip_of(self.host)}:{self.port}"

    @property
    def probe_address(self) -> str:
        return self.lan.forward(self.host, self.port)
