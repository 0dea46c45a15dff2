"""Plumbing shared by the atheris harnesses (one per parser of outside input, fuzz/<parser>.py).

A harness's `check(data)` feeds one input to the parser as the service would and lets the parser's
own validation error (the one the service turns into a clean refusal: a config error at start, a
kept old file on reload, INVALID_ARGUMENT on a call) pass; anything else propagates, and atheris
reports it as a crash with the input that caused it.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import atheris


def fuzz(check: Callable[[bytes], None]) -> None:
    """Runs libFuzzer over `check`; command-line flags are libFuzzer's (corpus dirs, -max_total_time...)."""
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()


class ScratchFile:
    """One file, rewritten per input, for parsers whose entry point reads a path (as the services do)."""

    def __init__(self, relative: str) -> None:
        self._folder = tempfile.TemporaryDirectory(prefix="infermesh-fuzz-")
        self.root = Path(self._folder.name)
        self.path = self.root / relative
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, data: bytes) -> Path:
        self.path.write_bytes(data)
        return self.path
