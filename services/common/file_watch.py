"""A config file the gateway reloads when it changes (the tenants file, the routing file).

`WatchedFile` holds what the last good version of the file loaded into and replaces it when
the file changes: `poll()` (cheap: one stat) is called every second or so, `reload()` on SIGHUP.
A change is a different (mtime, size, inode), which also catches the symlink swap a Kubernetes
ConfigMap or Secret volume makes. The first load happens in the constructor and raises, so a
gateway never starts on a bad file; a bad file later is refused with one log line, the old value
stays, and it is not re-read until the file changes again. A good file is swapped in with one
assignment: a call that already read the old value finishes with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
Signature = tuple[int, int, int] | None


@dataclass(frozen=True)
class ReloadResult:
    applied: bool
    # Why it was refused (the load error's message), or a summary of what was applied.
    reason: str


class WatchedFile(Generic[T]):
    """`current` is what `load(path)` last returned without raising `error`."""

    def __init__(
        self,
        path: str | os.PathLike,
        load: Callable[[str | os.PathLike], T],
        *,
        what: str,
        error: type[Exception],
        describe: Callable[[T], str],
        on_reload: Callable[[T], None] | None = None,
        log: logging.Logger | None = None,
        stat: Callable[[str | os.PathLike], os.stat_result] = os.stat,
    ) -> None:
        """what: the file's name in log lines ("tenant config"); describe: a summary of a value
        ("3 tenants"); on_reload: called with the first value and every accepted one."""
        self.path = path
        self.what = what
        self._load = load
        self._error = error
        self._describe = describe
        self._on_reload = on_reload
        self._log = log or logging.getLogger(__name__)
        self._stat = stat
        self._signature = self._file_signature()
        self.current: T = load(path)
        self._notify(self.current)

    def poll(self) -> ReloadResult | None:
        """Reload if the file's mtime, size or inode changed; None when unchanged."""
        if self._file_signature() == self._signature:
            return None
        return self.reload()

    def reload(self) -> ReloadResult:
        # Remember the signature even if the file is bad, so a bad file is reported once rather
        # than every poll; the next edit triggers another attempt.
        self._signature = self._file_signature()
        kept = self._describe(self.current)
        try:
            value = self._load(self.path)
        except self._error as exc:
            self._log.error("refused %s, keeping the previous one (%s): %s", self.what, kept, exc)
            return ReloadResult(applied=False, reason=str(exc))
        self.current = value
        self._notify(value)
        summary = f"{self.path}: loaded {self._describe(value)}"
        self._log.info("%s reloaded: %s", self.what, summary)
        return ReloadResult(applied=True, reason=summary)

    def _notify(self, value: T) -> None:
        if self._on_reload is not None:
            self._on_reload(value)

    def _file_signature(self) -> Signature:
        try:
            st = self._stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
