"""python -m services.scheduler [--flags]; see services/scheduler/config.py."""

from services.common.config import load_config
from services.common.server import freeze_long_lived, run
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import SchedulerService


def _load():
    config = load_config(SchedulerConfig, "scheduler")
    service = SchedulerService(config)
    freeze_long_lived()  # start-up made what lives as long as the process
    return config, service


if __name__ == "__main__":
    run("scheduler", _load)
