"""The CLI's one domain error: bad input the caller can fix (the command exits 2 with its message)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input the caller can fix (exit 2)."""
