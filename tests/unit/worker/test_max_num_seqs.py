"""--max-num-seqs: a repository generator's running sequences per step, overriding its manifest."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError
from services.worker.config import WorkerConfig
from services.worker.model_runtime import GeneratorRuntime, load_repository_runtime
from services.worker.server import make_runtime


def test_the_manifest_value_is_the_default(tinylm):
    hello = GeneratorRuntime(tinylm, num_kv_blocks=64).hello("w-1")
    assert hello.capacity.max_num_seqs == tinylm.manifest.envelope.max_num_seqs


def test_the_flag_overrides_the_manifest_in_the_hello(tinylm):
    hello = GeneratorRuntime(tinylm, num_kv_blocks=64, max_num_seqs=48).hello("w-1")
    assert hello.capacity.max_num_seqs == 48
    assert hello.capacity.max_num_batched_tokens == tinylm.manifest.envelope.max_num_batched_tokens


def test_a_runtime_loaded_from_the_repository_takes_the_flag(model_root):
    config = WorkerConfig(model_repository=str(model_root), model_name="tinylm", max_num_seqs=40, num_kv_blocks=64)
    assert load_repository_runtime(config, num_threads=1).hello("w-1").capacity.max_num_seqs == 40


def test_a_classifier_refuses_the_flag_before_serving(model_root):
    config = WorkerConfig(model_repository=str(model_root), model_name="digits", max_num_seqs=8)
    with pytest.raises(ConfigError, match="applies to generators"):
        load_repository_runtime(config, num_threads=1)


@pytest.mark.parametrize("model", ["toy-generator", "mock-generator"])
def test_toy_and_mock_models_refuse_the_flag(model):
    with pytest.raises(ConfigError, match="applies to repository generators"):
        make_runtime(WorkerConfig(model_name=model, max_num_seqs=8), num_threads=1)


def test_a_negative_value_is_a_configuration_error():
    with pytest.raises(ConfigError, match="max_num_seqs must be >= 0"):
        WorkerConfig(max_num_seqs=-1)
