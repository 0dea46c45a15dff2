from __future__ import annotations

import pytest

from services.common.config import ConfigError, env_names, load_config
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig


def test_flag_wins_over_environment_which_wins_over_default():
    env = {"INFERMESH_GATEWAY_PORT": "6000", "INFERMESH_GATEWAY_HOP_MARGIN_MS": "7.5"}
    config = load_config(GatewayConfig, "gateway", ["--port", "7000", "--allow-anonymous"], env)
    assert config.port == 7000
    assert config.hop_margin_ms == 7.5
    assert config.default_deadline_ms == 30_000.0


def test_tuple_fields_read_comma_separated_values():
    config = load_config(SchedulerConfig, "scheduler", [], {"INFERMESH_SCHEDULER_PREFERRED_BATCH_SIZES": "4, 8"})
    assert config.preferred_batch_sizes == (4, 8)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"INFERMESH_GATEWAY_PORT": "abc"}, "INFERMESH_GATEWAY_PORT='abc': expected an integer"),
        ({"INFERMESH_GATEWAY_PORT": "70000"}, "port must be 0..65535, got 70000"),
        ({"INFERMESH_GATEWAY_MAX_DEADLINE_MS": "10"}, "max_deadline_ms (10.0) must be >= default_deadline_ms"),
        ({"INFERMESH_GATEWAY_SCHEDULER_ADDRESS": "nowhere"}, "scheduler_address must be host:port, got 'nowhere'"),
        ({"INFERMESH_GATEWAY_LOG_LEVEL": "LOUD"}, "log_level must be DEBUG, INFO, WARNING or ERROR, got 'LOUD'"),
    ],
)
def test_bad_values_fail_with_a_message_naming_the_setting(env, message):
    with pytest.raises(ConfigError) as caught:
        load_config(GatewayConfig, "gateway", [], env)
    assert str(caught.value).startswith(message)


def test_bad_boolean_names_its_source():
    with pytest.raises(ConfigError, match=r"--port='x': expected an integer"):
        load_config(WorkerConfig, "worker", ["--port", "x"], {})


def test_env_names_lists_every_variable_a_service_reads():
    names = env_names(WorkerConfig, "worker")
    assert {"INFERMESH_WORKER_SCHEDULER_ADDRESS", "INFERMESH_WORKER_MODEL_NAME", "INFERMESH_WORKER_PORT"} <= names
    assert all(name.startswith("INFERMESH_WORKER_") for name in names)


def test_model_version_cannot_be_empty_because_there_is_no_latest():
    with pytest.raises(ConfigError, match="there is no 'latest'"):
        load_config(WorkerConfig, "worker", ["--model-version", ""], {})


def test_a_mistyped_variable_fails_at_start_and_suggests_the_real_name():
    with pytest.raises(ConfigError) as info:
        load_config(GatewayConfig, "gateway", [], {"INFERMESH_GATEWAY_MAX_INFLIGHT": "10"})
    assert "unknown variable for the gateway: INFERMESH_GATEWAY_MAX_INFLIGHT (did you mean INFERMESH_GATEWAY_MAX_IN_FLIGHT?)" in str(info.value)


def test_unknown_variables_are_all_named_and_other_services_variables_are_left_alone():
    env = {"INFERMESH_WORKER_NUMTHREADS": "2", "INFERMESH_WORKER_ZZZ": "1",
           "INFERMESH_GATEWAY_PORT": "1", "INFERMESH_TRACE_FILE": "/tmp/x"}  # not the worker's: ignored
    with pytest.raises(ConfigError, match=r"unknown variables for the worker: INFERMESH_WORKER_NUMTHREADS \(did you "
                                          r"mean INFERMESH_WORKER_NUM_THREADS\?\), INFERMESH_WORKER_ZZZ;"):
        load_config(WorkerConfig, "worker", [], env)
    load_config(SchedulerConfig, "scheduler", [], env)  # no INFERMESH_SCHEDULER_* at all: fine


@pytest.mark.parametrize(("variable", "refused", "least", "message"), [
    ("INFERMESH_WORKER_NUM_KV_BLOCKS", "-1", "0", "num_kv_blocks must be >= 0, got -1"),
    ("INFERMESH_WORKER_ATTACH_KEEPALIVE_MS", "999", "1000", "attach_keepalive_ms must be >= 1000, got 999"),
    ("INFERMESH_WORKER_TOY_COMPUTE_MS", "-0.5", "0", "toy_compute_ms must be >= 0, got -0.5"),
])
def test_a_declared_minimum_is_checked_when_the_config_is_made(variable, refused, least, message):
    with pytest.raises(ConfigError, match=message):
        load_config(WorkerConfig, "worker", [], {variable: refused})
    load_config(WorkerConfig, "worker", [], {variable: least})  # the minimum itself is allowed
