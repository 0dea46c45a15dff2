"""Virtualenvs for stock clients whose pins clash with the project's (openai, tritonclient).

Each lives at the repository root (`.venv-<name>/`, git-ignored), is built once from PyPI and is
reused while its marker file names the same requirement. Where it cannot be built (no PyPI), the
test that needs it is skipped with pip's last lines.

A server that runs our code inside another framework (the Ray Serve peer, bench/harness/ray_serve_peer.py)
names it with `link_project=True`: its venv then also reaches the repository and .venv's packages
(torch, numba...) through a .pth file, after its own, so the framework keeps the versions pip chose for it.

A test module that needs one names it in SIDE_VENV = (name, requirement[, link_project]); once the session has
collected its tests, tests/conftest.py starts those builds in the background (`prebuild`, one after
the other), so pip's downloads and unpacking (10-60 s each on a fresh clone of the 2-core machine)
overlap the tests that run first. `stop_building` (at the session's end) ends any pip still running.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest

from tools.testbed.processes import ROOT

# One step (venv, pip install) at most this long: ray[serve] (~560 MB installed) took 152 s at load 8.
PIP_STEP_TIMEOUT_S = 480


class _Build(threading.Thread):
    """One side venv's build; `python` when done, else `skip_reason` (or `error`: pip timed out)."""

    def __init__(self, name: str, requirement: str, after: _Build | None, link_project: bool = False) -> None:
        super().__init__(name=f"side-venv-{name}", daemon=True)
        self.venv_name, self.requirement, self.link_project = name, requirement, link_project
        self.after = after  # one build at a time: two pips side by side took longer than one after the other
        self.python: Path | None = None
        self.skip_reason = ""
        self.error: Exception | None = None
        self._stopped = False
        self._running: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        if self.after is not None:
            self.after.join()
        # Under pytest-xdist every test process may build the same venv: one builds, the others wait
        # on the lock and then find its marker.
        with open(ROOT / f".venv-{self.venv_name}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._build()

    def _build(self) -> None:
        venv = ROOT / f".venv-{self.venv_name}"
        python = venv / "bin" / "python"
        marker = venv / f".installed-{re.sub(r'[^A-Za-z0-9.=-]+', '-', self.requirement)}"
        if marker.exists():
            self._link(python)
            self.python = python
            return
        shutil.rmtree(venv, ignore_errors=True)
        # No pip of its own (ensurepip took 2.5 of the 6.3 s an openai venv took on the quiet box): the
        # project's pip installs into it (--python). A client's venv is not byte-compiled at install
        # (1 s more; its script compiles what it imports, once); a server's is (link_project: Ray's
        # processes start side by side and would each compile the same modules).
        compile_flag = [] if self.link_project else ["--no-compile"]
        steps = (
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--disable-pip-version-check",
             *compile_flag, self.requirement],
        )
        for step in steps:
            with self._lock:
                if self._stopped:
                    self.skip_reason = "the session ended first"
                    return
                # Its own process group: venv runs ensurepip, and pip its build steps, as children.
                self._running = subprocess.Popen(step, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                                 start_new_session=True)
            try:
                output, _ = self._running.communicate(timeout=PIP_STEP_TIMEOUT_S)
            except subprocess.TimeoutExpired as exc:
                _signal_group(self._running, signal.SIGKILL)
                self._running.communicate()
                self.error = exc  # the test errs, as it did when it built the venv itself
                return
            if self._running.returncode != 0:
                shutil.rmtree(venv, ignore_errors=True)
                tail = "\n".join(output.strip().splitlines()[-5:])
                self.skip_reason = f"cannot install {self.requirement} into {venv.name}: {tail}"
                return
        self._link(python)
        marker.touch()
        self.python = python

    def _link(self, python: Path) -> None:
        """The .pth that puts the repository and .venv's packages after the venv's own (link_project)."""
        if not self.link_project:
            return
        purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        ours = sysconfig.get_paths()["purelib"]  # the project's .venv: pytest runs in it
        # addsitedir also reads .venv's own .pth files (the editable project, the generated stubs).
        (Path(purelib) / "zz-infermesh-project.pth").write_text(f"{ROOT}\nimport site; site.addsitedir({ours!r})\n")

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._running is not None and self._running.poll() is None:
                _signal_group(self._running, signal.SIGTERM)
        self.join(timeout=30)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass  # ended meanwhile


_builds: dict[tuple[str, str], _Build] = {}


def prebuild(name: str, requirement: str, link_project: bool = False) -> None:
    """Starts building `.venv-<name>` with `requirement` in the background (once per session)."""
    if (name, requirement) not in _builds:
        last = next(reversed(_builds.values()), None)
        build = _builds[(name, requirement)] = _Build(name, requirement, last, link_project)
        build.start()


def side_venv_python(name: str, requirement: str, link_project: bool = False) -> Path:
    """The python of `.venv-<name>` with `requirement` installed (e.g. "openai==3.51.0")."""
    prebuild(name, requirement, link_project)
    build = _builds[(name, requirement)]
    build.join()
    if build.error is not None:
        raise build.error
    if build.python is None:
        pytest.skip(build.skip_reason)
    return build.python


def stop_building() -> None:
    """Ends every build still running (its venv is left without its marker, so the next run starts over)."""
    for build in _builds.values():
        build.stop()
