"""python -m services.scheduler [--flags]; see services/scheduler/config.py."""

from services.common.config import load_config
from services.common.server import run
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import SchedulerService


def _load():
    config = load_config(SchedulerConfig, "scheduler")
    return config, SchedulerService(config)


if __name__ == "__main__":
    run("scheduler", _load)
