"""deploy/local/Procfile (`make up`): every worker runs with a thread count that leaves the scheduler
and gateway their share of a small machine."""

from __future__ import annotations

import re
import shlex

from deploy_tools import REPO
from honcho.environ import parse_procfile

from services.common.config import load_config
from services.worker.config import WorkerConfig

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
