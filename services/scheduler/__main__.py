"""python -m services.scheduler [--flags]; see services/scheduler/config.py."""

import gc

from services.common.config import load_config
from services.common.server import run
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import SchedulerService


def _load():
    config = load_config(SchedulerConfig, "scheduler")
    service = SchedulerService(config)
    # What start-up made (modules, protobuf descriptors, the service) lives as long as the process:
    # frozen out of the collector's generations, a full collection no longer walks it. Under a
    # classify flood each gen-2 collection took 35-40 ms of the event loop, ~7 ms frozen
    # (docs/scheduler.md, "Fairness and the standing queue").
    gc.collect()
    gc.freeze()
    return config, service


if __name__ == "__main__":
    run("scheduler", _load)
