"""The live progress line on stderr: rates achieved, in flight, errors, and the generator's own lag."""

from __future__ import annotations

import sys
from typing import TextIO

from loadtest.runner import Phase, ProgressSnapshot


def format_progress(s: ProgressSnapshot, level_unit: str = "rps") -> str:
    target = f"{s.target:.1f}/s" if level_unit == "rps" else f"{s.target:.0f} clients"
    line = (f"[{s.phase.value:>8}] {s.elapsed_s:5.1f}/{s.total_s:.0f}s  sent {s.sent_rps:6.1f}/s (target {target})"
            f"  done {s.done_rps:6.1f}/s  in-flight {s.num_in_flight:4d}  ok {s.num_done - s.num_errors}"
            f"  err {s.num_errors}  lag {s.max_lag_ms:6.1f} ms")
    if s.behind:
        line += "  WARNING: generator behind schedule"
    return line


class ProgressPrinter:
    """Rewrites one line on a terminal; elsewhere (CI logs) prints a line every `plain_every_s`
    and every warning."""

    def __init__(self, stream: TextIO | None = None, level_unit: str = "rps", plain_every_s: float = 5.0,
                 is_tty: bool | None = None) -> None:
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty() if is_tty is None else is_tty
        self._unit = level_unit
        self._plain_every_s = plain_every_s
        self._next_plain_s = 0.0
        self._last: ProgressSnapshot | None = None

    def __call__(self, snapshot: ProgressSnapshot) -> None:
        line = format_progress(snapshot, self._unit)
        if self._tty:
            self._stream.write("\r\x1b[2K" + line)
            if snapshot.behind:
                self._stream.write("\n")
        elif snapshot.behind or snapshot.elapsed_s >= self._next_plain_s or snapshot.phase is Phase.DRAIN:
            self._stream.write(line + "\n")
            self._next_plain_s = snapshot.elapsed_s + self._plain_every_s
        self._stream.flush()
        self._last = snapshot

    def close(self) -> None:
        if self._tty and self._last is not None:
            self._stream.write("\n")
            self._stream.flush()
