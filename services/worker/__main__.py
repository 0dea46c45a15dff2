"""python -m services.worker [--flags]; see services/worker/config.py."""

from services.common.config import load_config
from services.common.server import run
from services.worker.config import WorkerConfig
from services.worker.server import WorkerService


def _load():
    config = load_config(WorkerConfig, "worker")
    return config, WorkerService(config)


if __name__ == "__main__":
    run("worker", _load)
