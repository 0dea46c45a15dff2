"""deploy/local/Procfile (`make up`): every worker runs with a thread count that leaves the scheduler
and gateway their share of a small machine; `tools.mesh wait` knows when the quota store answers."""

from __future__ import annotations

import re
import shlex
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from deploy_tools import REPO
from honcho.environ import parse_procfile

from services.common.config import load_config
from services.worker.config import WorkerConfig
from tools.mesh import store_answers, wait

PROCFILE = REPO / "deploy" / "local" / "Procfile"
_DEFAULTED = re.compile(r"\$\{([A-Z_]+):?-([^}]*)\}")


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
