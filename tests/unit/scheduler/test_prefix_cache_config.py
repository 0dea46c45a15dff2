from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.scheduler.attach_types import WorkerCapacity
from services.scheduler.config import SchedulerConfig
from services.scheduler.step_scheduler_config import step_scheduler_config


def test_the_cache_is_on_by_default_and_the_flag_or_variable_turns_it_off():
    assert load_config(SchedulerConfig, "scheduler", [], {}).prefix_cache is True
    assert load_config(SchedulerConfig, "scheduler", ["--prefix-cache", "off"], {}).prefix_cache is False
    off = load_config(SchedulerConfig, "scheduler", [], {"INFERMESH_SCHEDULER_PREFIX_CACHE": "off"})
    assert off.prefix_cache is False


def test_public_prefixes_are_a_json_list_of_texts_that_reaches_each_workers_step_scheduler():
    config = load_config(SchedulerConfig, "scheduler", ["--public-prefixes", '["You are kind.", "Q, A: "]'], {})
    assert config.public_prefix_texts() == ("You are kind.", "Q, A: ")
    capacity = WorkerCapacity(num_kv_blocks=64, block_size=16, max_seq_len=512)
    step_config = step_scheduler_config(config, capacity)
    assert step_config.public_prefix_texts == ("You are kind.", "Q, A: ") and step_config.enable_prefix_cache


@pytest.mark.parametrize("value, message", [
    ("You are kind.", "public_prefixes must be a JSON list of strings"),
    ('{"a": 1}', "public_prefixes must be a JSON list of non-empty strings"),
    ('["ok", ""]', "public_prefixes must be a JSON list of non-empty strings"),
    ('["ok", 3]', "public_prefixes must be a JSON list of non-empty strings"),
])
def test_a_malformed_public_prefix_list_refuses_to_start(value, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SchedulerConfig, "scheduler", ["--public-prefixes", value], {})
