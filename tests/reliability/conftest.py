"""Fixtures of the reliability tests."""

from __future__ import annotations

import pytest

from tools.testbed.mesh_replicas import PARTITION_HOSTS
from tools.testbed.netns import lan, netns_unavailable


@pytest.fixture
def network():
    """Network-namespace hosts for the partition tests, all removed afterwards (skips without netns)."""
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with lan(PARTITION_HOSTS) as network:
        yield network
