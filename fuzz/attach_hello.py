"""atheris: the first message of a worker's Attach stream as the scheduler reads it
(services/scheduler/attach_session.py: decoded, checked, then the model registry takes the worker)."""

from __future__ import annotations

import asyncio

import atheris
from google.protobuf.message import DecodeError

from fuzz.harness import fuzz

with atheris.instrument_imports(include=["services.scheduler"]):
    from infermesh.v1 import scheduler_pb2
    from services.common.errors import InfermeshError
    from services.scheduler.attach_codec import decode_hello
    from services.scheduler.attach_session import check_hello
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.model_registry import ModelRegistry
    from services.scheduler.worker_link import WorkerLink

CONFIG = SchedulerConfig()


def check(data: bytes) -> None:
    try:
        message = scheduler_pb2.WorkerMessage.FromString(data)
    except DecodeError:
        return  # grpc answers INVALID_ARGUMENT (services/common/request_decoding.py)
    if message.WhichOneof("kind") != "hello":
        return  # the servicer refuses it before reading anything (INVALID_ARGUMENT)
    _LOOP.run(_attach(message.hello))


async def _attach(hello: scheduler_pb2.WorkerHello) -> None:
    """As Attach does it, on an event loop (a pool starts its dispatch task), leaving no task behind."""
    try:
        decoded = decode_hello(hello)
        check_hello(decoded)
        ModelRegistry(CONFIG).attach(WorkerLink(decoded))
    except InfermeshError:
        pass
    finally:
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_LOOP = asyncio.Runner()


if __name__ == "__main__":
    fuzz(check)
