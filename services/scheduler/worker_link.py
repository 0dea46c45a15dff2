"""One attached worker as the scheduler sees it: what it declared, commands out, results in."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from services.common.errors import Unavailable
from services.scheduler.attach_types import (
    AbortCommand,
    BatchCommand,
    BatchOutcome,
    Command,
    DrainCommand,
    ModelKey,
    StepCommand,
    StepOutcome,
    StepsCommand,
    WorkerHello,
)

__all__ = ["ModelKey", "WorkerGone", "WorkerLink"]

_ids = itertools.count(1)


class WorkerGone(Unavailable):
    """The worker's Attach stream broke while it held this work."""


class WorkerLink:
    """Commands are queued as domain objects; the Attach session encodes them as it writes."""

    def __init__(self, hello: WorkerHello) -> None:
        self.hello = hello
        self.worker_id = hello.worker_id
        # Unique per Attach stream: a worker re-dialling keeps its worker_id, and its new stream may
        # attach before the scheduler has noticed the old one broke, so pools key links by this.
        self.link_id = f"{hello.worker_id}#{next(_ids)}"
        self.model = hello.model
        self.draining = False
        self.closed = asyncio.Event()
        self.kv_blocks_used = 0
        self.last_heard_s = 0.0  # monotonic seconds of the last message from the worker
        self._commands: asyncio.Queue[Command | None] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future[Any]] = {}

    @staticmethod
    def next_id() -> int:
        return next(_ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def usable(self) -> bool:
        return not self.draining and not self.closed.is_set()

    def execute_batch(self, batch: BatchCommand) -> asyncio.Future[BatchOutcome]:
        return self._send(batch.batch_id, batch)

    def run_step(self, step: StepCommand) -> asyncio.Future[StepOutcome]:
        return self._send(step.plan.step_id, step)

    def run_steps(self, steps: StepsCommand) -> list[asyncio.Future[StepOutcome]]:
        """Several steps in one message; a result future per step, in order."""
        return self._send_many([plan.step_id for plan in steps.plans], steps)

    def abort(self, seq_ids: tuple[int, ...]) -> None:
        """The worker forgets these sequences (their mirrors and pages)."""
        if not self.closed.is_set():
            self._commands.put_nowait(AbortCommand(seq_ids))

    def drain(self, grace_ms: int) -> None:
        """Ask the worker to finish what it holds and re-dial; it gets no new work meanwhile."""
        self.draining = True
        if not self.closed.is_set():
            self._commands.put_nowait(DrainCommand(grace_ms))

    def _send(self, command_id: int, command: Command) -> asyncio.Future[Any]:
        return self._send_many([command_id], command)[0]

    def _send_many(self, result_ids: list[int], command: Command) -> list[asyncio.Future[Any]]:
        """Queues the command; a future per result it will bring back."""
        if self.closed.is_set():
            raise WorkerGone(f"worker {self.worker_id} is gone")
        loop = asyncio.get_running_loop()
        futures = []
        for result_id in result_ids:
            future: asyncio.Future[Any] = loop.create_future()
            self._pending[result_id] = future
            futures.append(future)
        self._commands.put_nowait(command)
        return futures

    async def next_command(self) -> Command | None:
        """The next command to write to the stream; None once the link is closing."""
        return await self._commands.get()

    def on_result(self, command_id: int, result: BatchOutcome | StepOutcome) -> None:
        future = self._pending.pop(command_id, None)
        if future is not None and not future.done():
            future.set_result(result)

    def close(self) -> None:
        """The stream ended: fail everything still pending so its owners can re-dispatch."""
        if self.closed.is_set():
            return
        self.closed.set()
        self._commands.put_nowait(None)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(WorkerGone(f"worker {self.worker_id} went away"))
        self._pending.clear()

    def end_stream(self) -> None:
        """Politely end the stream (drain finished): the writer sees None and returns."""
        self._commands.put_nowait(None)
