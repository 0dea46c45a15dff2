"""Virtualenvs for stock clients whose pins clash with the project's (openai, tritonclient).

Each lives at the repository root (`.venv-<name>/`, git-ignored), is built once from PyPI and is
reused while its marker file names the same requirement. Where it cannot be built (no PyPI), the
test that needs it is skipped with pip's last lines.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.testbed.processes import ROOT


def side_venv_python(name: str, requirement: str) -> Path:
    """The python of `.venv-<name>` with `requirement` installed (e.g. "openai==3.51.0")."""
    venv = ROOT / f".venv-{name}"
    python = venv / "bin" / "python"
    marker = venv / f".installed-{re.sub(r'[^A-Za-z0-9.=-]+', '-', requirement)}"
    if marker.exists():
        return python
    shutil.rmtree(venv, ignore_errors=True)
    steps = (
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", requirement],
    )
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=240)
        if done.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            pytest.skip(f"cannot install {requirement} into {venv.name}: {tail}")
    marker.touch()
    return python
