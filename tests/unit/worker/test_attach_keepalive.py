"""The Attach stream's keepalive: the defaults a frozen scheduler is noticed by, and the bounds."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.scheduler.config import SchedulerConfig
from services.worker.attach_client import attach_channel_options
from services.worker.config import WorkerConfig


def test_default_pings_every_15_s_wait_5_s_and_stay_above_the_schedulers_minimum_gap():
    options = dict(attach_channel_options(WorkerConfig().attach_keepalive_ms))
    assert options["grpc.keepalive_time_ms"] == 15_000
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == 5_000
    # A ping closer than the scheduler accepts would earn a GOAWAY (too_many_pings) instead of an answer.
    assert options["grpc.http2.min_time_between_pings_ms"] >= SchedulerConfig().keepalive_min_ping_interval_ms


@pytest.mark.parametrize("build", [lambda: WorkerConfig(attach_keepalive_ms=999),
                                   lambda: SchedulerConfig(keepalive_min_ping_interval_ms=10)])
def test_sub_second_keepalives_are_refused(build):
    with pytest.raises(ConfigError, match="must be >= 1000"):
        build()
