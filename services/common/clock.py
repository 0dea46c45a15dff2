"""The clock every piece of logic takes by injection: monotonic seconds, as `time.monotonic` gives
them, so tests drive a fake one (tools/testbed/fake_clock.py) instead of sleeping."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
