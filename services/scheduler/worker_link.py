"""One attached worker as the scheduler sees it: what it declared, commands out, results in."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

from infermesh.v1 import scheduler_pb2
from services.common.errors import Unavailable

_ids = itertools.count(1)


class WorkerGone(Unavailable):
    """The worker's Attach stream broke while it held this work."""


@dataclass(frozen=True)
class ModelKey:
    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name}:{self.version}"


class WorkerLink:
    def __init__(self, hello: scheduler_pb2.WorkerHello) -> None:
        self.hello = hello
        self.worker_id = hello.worker_id
        # Unique per Attach stream: a worker re-dialling keeps its worker_id, and its new stream may
        # attach before the scheduler has noticed the old one broke, so pools key links by this.
        self.link_id = f"{hello.worker_id}#{next(_ids)}"
        self.model = ModelKey(hello.model.name, hello.model.version)
        self.draining = False
        self.closed = asyncio.Event()
        self.kv_blocks_used = 0
        self.last_heard_s = 0.0  # monotonic seconds of the last message from the worker
        self._commands: asyncio.Queue[scheduler_pb2.SchedulerCommand | None] = asyncio.Queue()
        self._pending: dict[int, asyncio.Future] = {}

    @staticmethod
    def next_id() -> int:
        return next(_ids)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    @property
    def usable(self) -> bool:
        return not self.draining and not self.closed.is_set()

    def execute_batch(self, batch: scheduler_pb2.ExecuteBatch) -> asyncio.Future:
        return self._send(batch.batch_id, scheduler_pb2.SchedulerCommand(execute_batch=batch))

    def run_step(self, step: scheduler_pb2.RunStep) -> asyncio.Future:
        return self._send(step.step_id, scheduler_pb2.SchedulerCommand(run_step=step))

    def abort(self, abort: scheduler_pb2.Abort) -> None:
        if not self.closed.is_set():
            self._commands.put_nowait(scheduler_pb2.SchedulerCommand(abort=abort))

    def drain(self, grace_ms: int) -> None:
        """Ask the worker to finish what it holds and re-dial; it gets no new work meanwhile."""
        self.draining = True
        if not self.closed.is_set():
            self._commands.put_nowait(scheduler_pb2.SchedulerCommand(drain=scheduler_pb2.Drain(grace_ms=grace_ms)))

    def _send(self, command_id: int, command: scheduler_pb2.SchedulerCommand) -> asyncio.Future:
        if self.closed.is_set():
            raise WorkerGone(f"worker {self.worker_id} is gone")
        future = asyncio.get_running_loop().create_future()
        self._pending[command_id] = future
        self._commands.put_nowait(command)
        return future

    async def next_command(self) -> scheduler_pb2.SchedulerCommand | None:
        """The next command to write to the stream; None once the link is closing."""
        return await self._commands.get()

    def on_result(self, command_id: int, result) -> None:
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
