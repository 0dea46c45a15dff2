"""Plaintext only behind an explicit --plaintext: a service given no certificate refuses to start."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.config import ConfigError
from services.gateway.config import GatewayConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from tools.testbed.processes import ROOT


@pytest.mark.parametrize(("config", "name"), [(GatewayConfig, "gateway"), (SchedulerConfig, "scheduler"),
                                              (WorkerConfig, "worker")])
def test_neither_certificate_nor_plaintext_names_both_ways_out(config, name):
    settings = config(allow_anonymous=True) if config is GatewayConfig else config()
    with pytest.raises(ConfigError) as refused:
        settings.require_listener_security(name)
    assert "--tls-cert-file" in str(refused.value) and "--plaintext" in str(refused.value)
    assert f"INFERMESH_{name.upper()}_PLAINTEXT=true" in str(refused.value)


def test_plaintext_or_a_certificate_starts_and_both_together_contradict():
    SchedulerConfig(plaintext=True).require_listener_security("scheduler")
    SchedulerConfig(tls_cert_file="c.pem", tls_key_file="k.pem").require_listener_security("scheduler")
    with pytest.raises(ConfigError, match="contradict"):
        SchedulerConfig(plaintext=True, tls_cert_file="c.pem", tls_key_file="k.pem")


def test_a_scheduler_started_without_either_exits_2_before_listening():
    done = subprocess.run([sys.executable, "-m", "services.scheduler", "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("scheduler: configuration error: no TLS certificate:")
    assert "listening" not in done.stderr
