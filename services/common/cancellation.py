"""A loop that is cancelled ends, even when a library under it swallowed the cancellation.

Python 3.11's task counts each cancel() it was asked for (`Task.cancelling()`); a library that catches
CancelledError and carries on (valkey's asyncio client did, about one run in two of the quota-store
tests) leaves that count raised, and the loop around it would go on to its next sleep, which nobody
cancels again: the gateway's close() then waits for it forever.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelling() -> None:
    """Raises CancelledError when the current task was asked to stop and has not yet."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
