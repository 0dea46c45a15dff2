"""deploy/local/Procfile (`make up`): every worker runs with a thread count that leaves the scheduler
and gateway their share of a small machine; `tools.mesh wait` knows when the quota store answers;
`tools.mesh keep` restarts a scheduler that was stopped or killed, as a Deployment would."""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from deploy_tools import REPO
from honcho.environ import parse_procfile

from services.common.config import load_config
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tools.mesh import keep_running, store_answers, wait

PROCFILE = REPO / "deploy" / "local" / "Procfile"
_DEFAULTED = re.compile(r"\$\{([A-Z][A-Z0-9_]*):?-([^}]*)\}")


def _argv_with_defaults(command: str) -> list[str]:
    """The command as honcho runs it with no MESH_* variables set."""
    return shlex.split(_DEFAULTED.sub(lambda m: m.group(2), command))


def _workers() -> dict[str, list[str]]:
    processes = parse_procfile(PROCFILE.read_text()).processes
    return {name: _argv_with_defaults(command) for name, command in processes.items()
            if "services.worker" in command}


def test_local_workers_run_one_thread_each_by_default():
    workers = _workers()
    assert set(workers) == {"classifier", "generator"}
    for name, argv in workers.items():
        flags = argv[argv.index("services.worker") + 1:]
        config = load_config(WorkerConfig, "worker", argv=flags, environ={})
        assert config.num_threads == 1, name


def test_local_worker_threads_can_be_raised_with_one_variable():
    for command in parse_procfile(PROCFILE.read_text()).processes.values():
        if "services.worker" in command:
            assert "--num-threads ${MESH_WORKER_THREADS:-1}" in command


def _processes() -> dict[str, list[str]]:
    return {name: _argv_with_defaults(command) for name, command in parse_procfile(PROCFILE.read_text()).processes.items()}


def _flags(argv: list[str], module: str) -> list[str]:
    return argv[argv.index(module) + 1:]


def test_local_mesh_runs_two_schedulers_and_the_quota_store():
    processes = _processes()
    schedulers = {name: load_config(SchedulerConfig, "scheduler", argv=_flags(argv, "services.scheduler"), environ={})
                  for name, argv in processes.items() if "services.scheduler" in argv}
    assert sorted((c.port, c.metrics_port) for c in schedulers.values()) == [(50052, 9102), (50053, 9105)]
    (store,) = [argv for argv in processes.values() if "tools.quota_store" in argv]
    assert store[store.index("--port") + 1] == "6390"


def test_gateway_and_workers_are_given_every_scheduler_and_the_gateway_the_store():
    processes = _processes()
    every_scheduler = ",".join(
        f"127.0.0.1:{load_config(SchedulerConfig, 'scheduler', argv=_flags(argv, 'services.scheduler'), environ={}).port}"
        for argv in processes.values() if "services.scheduler" in argv)
    (gateway,) = [argv for argv in processes.values() if "services.gateway" in argv]
    config = load_config(GatewayConfig, "gateway", argv=_flags(gateway, "services.gateway"), environ={})
    assert config.scheduler_address == every_scheduler
    (store,) = [argv for argv in processes.values() if "tools.quota_store" in argv]
    assert config.quota_store_address == f"127.0.0.1:{store[store.index('--port') + 1]}"
    for name, argv in _workers().items():
        worker = load_config(WorkerConfig, "worker", argv=_flags(argv, "services.worker"), environ={})
        assert worker.scheduler_address == every_scheduler, name


def test_make_up_waits_for_every_grpc_service_and_the_store():
    # `make up` is done only when every process of the Procfile answers: each gRPC port in
    # MESH_HEALTH, the store in MESH_STORE.
    makefile = (REPO / "Makefile").read_text()
    health = re.search(r"^MESH_HEALTH := ((?:.*\\\n)*.*)$", makefile, flags=re.MULTILINE).group(1)
    waited = {int(default) for default in re.findall(r":-(\d+)\}", health)}
    ports = set()
    for argv in _processes().values():
        module = next(a for a in argv if a.startswith(("services.", "tools.quota_store")))
        if module.startswith("services."):
            ports.add(int(argv[argv.index("--port") + 1]))
    assert waited == ports
    store = re.search(r"^MESH_STORE := (.*)$", makefile, flags=re.MULTILINE).group(1)
    assert re.findall(r":-(\d+)\}", store) == ["6390"]
    assert "--store $(MESH_STORE)" in makefile


# --------------------------------------------------------------------------- tools.mesh wait --store


@contextmanager
def one_reply_server(reply: bytes) -> Iterator[tuple[str, list[bytes]]]:
    """A TCP server on 127.0.0.1 that answers its first connection's first read with `reply`."""
    received: list[bytes] = []
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def serve() -> None:
            conn, _ = listener.accept()
            with conn:
                received.append(conn.recv(64))
                conn.sendall(reply)
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        yield f"127.0.0.1:{listener.getsockname()[1]}", received
        thread.join(timeout=5)


def test_store_is_ready_when_it_answers_ping_with_pong():
    with one_reply_server(b"+PONG\r\n") as (address, received):
        assert store_answers(address)
    assert received == [b"PING\r\n"]


def test_store_loading_or_absent_is_not_ready():
    with one_reply_server(b"-LOADING Valkey is loading the dataset in memory\r\n") as (address, _):
        assert not store_answers(address)
    with socket.create_server(("127.0.0.1", 0)) as unused:
        closed = f"127.0.0.1:{unused.getsockname()[1]}"
    assert not store_answers(closed)


def test_wait_names_the_store_that_never_answered(capsys):
    with socket.create_server(("127.0.0.1", 0)) as unused:
        closed = f"127.0.0.1:{unused.getsockname()[1]}"
    assert not wait([], None, [], timeout_s=0.3, stores=[closed])
    assert f"stores ['{closed}']" in capsys.readouterr().err


# --------------------------------------------------------------------------- tools.mesh keep


def test_keep_starts_a_command_again_each_time_it_exits(tmp_path):
    runs = tmp_path / "runs"
    child = [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x'); raise SystemExit(3)"]
    assert keep_running(child, restart_delay_s=0, max_restarts=2) == 3
    assert runs.read_text() == "xxx"


_DRAINING_CHILD = """
import signal, sys
def drain(signum, frame):
    print("drained", flush=True)
    sys.exit(7)
signal.signal(signal.SIGTERM, drain)
print("started", flush=True)
signal.pause()
"""


def test_keep_passes_sigterm_to_the_command_and_ends_with_it():
    keeper = subprocess.Popen(
        [sys.executable, "-m", "tools.mesh", "keep", "--restart-delay-s", "0", "--",
         sys.executable, "-c", _DRAINING_CHILD],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert keeper.stdout.readline() == "started\n"  # blocks until the child runs
        keeper.send_signal(signal.SIGTERM)  # the keeper only, as `make down` / a kubelet would
        assert keeper.wait(timeout=30) == 7
        assert keeper.stdout.read() == "drained\n", "drained once, and not started again"
    finally:
        if keeper.poll() is None:
            keeper.kill()
            keeper.wait()
