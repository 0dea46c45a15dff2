"""The worker decides its thread count at start and exports it before any compute library loads."""

from __future__ import annotations

import logging
import os

import pytest

from services.worker.config import WorkerConfig
from services.worker.cpu_allocation import ThreadSource
from services.worker.server import decide_threads
from services.worker.thread_settings import THREAD_ENV_VARS


@pytest.fixture
def clean_thread_env(monkeypatch):
    for name in THREAD_ENV_VARS:
        monkeypatch.setenv(name, "")  # registered with monkeypatch, so restored after the test


def test_explicit_num_threads_is_exported_for_every_pool_and_logged(clean_thread_env, caplog):
    with caplog.at_level(logging.INFO, logger="services.worker.server"):
        decision = decide_threads(WorkerConfig(num_threads=3))
    assert (decision.num_threads, decision.source) == (3, ThreadSource.FLAG)
    assert {name: os.environ[name] for name in THREAD_ENV_VARS} == {name: "3" for name in THREAD_ENV_VARS}
    assert "compute threads: 3 (source: flag; num_threads=3)" in caplog.text


def test_config_rejects_negative_num_threads():
    with pytest.raises(ValueError, match=r"num_threads must be >= 0, got -2"):
        WorkerConfig(num_threads=-2)
