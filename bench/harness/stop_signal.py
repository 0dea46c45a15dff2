"""SIGTERM ends a benchmark as Ctrl-C does, so what it started is stopped.

A benchmark holds its mesh (scheduler, workers, gateways) and its load processes in context managers. Python's
default SIGTERM kills the interpreter at once, so none of them ran their exit: a `bench_slo` stopped that way left
seven processes running. With `exit_on_sigterm()` the signal raises KeyboardInterrupt in the benchmark's own process,
and its `with` blocks stop everything on the way out. A process forked from it (the load pool) keeps the default:
its parent stops it, and a KeyboardInterrupt there would only print a traceback.
"""

from __future__ import annotations

import os
import signal
from types import FrameType


def exit_on_sigterm() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in this process (not in processes forked from it)."""
    owner = os.getpid()

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child inherited the handler: die of the signal, as by default
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
