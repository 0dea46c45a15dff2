"""SIGTERM to a scheduler: workers finish, detach, and the scheduler exits without waiting out its grace."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.processes import running_mesh

pytestmark = pytest.mark.integration


def test_draining_scheduler_refuses_re_attaching_workers_and_exits_promptly(tmp_path):
    with running_mesh(tmp_path) as mesh:
        scheduler = mesh.start_scheduler("--drain-grace-s", "20")
        mesh.start_worker("toy-classifier")
        mesh.start_worker("toy-generator")
        time.sleep(0.5)
        began = time.monotonic()
        scheduler.signal(signal.SIGTERM)
        assert scheduler.proc.wait(timeout=25) == 0
        assert time.monotonic() - began < 5, "drain ended when the workers left, not at the 20 s grace"
        assert "scheduler is draining" in "".join(p.log_tail(200) for p in mesh.processes if p.service == "worker")
