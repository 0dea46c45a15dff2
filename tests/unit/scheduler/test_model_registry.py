"""Which entry a ModelRef names at the scheduler."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgument
from services.scheduler.attach_codec import decode_hello
from services.scheduler.config import SchedulerConfig
from services.scheduler.model_registry import ModelRegistry
from services.scheduler.worker_link import WorkerLink
from services.worker.builtin_models import ToyGeneratorRuntime

UNVERSIONED = "toy-generator", ""


@pytest.fixture
async def registry():
    yield ModelRegistry(SchedulerConfig())
    tasks = asyncio.all_tasks() - {asyncio.current_task()}  # the pools' dispatch loops
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _attach(registry: ModelRegistry, version: str, worker_id: str) -> WorkerLink:
    link = WorkerLink(decode_hello(ToyGeneratorRuntime(version).hello(worker_id)))
    registry.attach(link)
    return link


async def test_an_unversioned_name_with_two_served_versions_is_ambiguous(registry):
    _attach(registry, "1", "w1")
    _attach(registry, "9", "w9")
    with pytest.raises(InvalidArgument, match="has versions 1, 9"):
        registry.resolve_generator(*UNVERSIONED)


async def test_a_version_whose_workers_all_left_does_not_make_the_name_ambiguous(registry):
    # Found by the reflection fuzz (tests/fuzz): one Attach declaring a made-up version "9" of a served
    # model left an entry behind, and every Generate without a version was refused from then on.
    _attach(registry, "1", "w1")
    registry.detach(_attach(registry, "9", "w9"))
    assert registry.resolve_generator(*UNVERSIONED).key.version == "1"
    registry.detach(next(iter(registry.resolve_generator(*UNVERSIONED).pool.workers)))
    with pytest.raises(InvalidArgument, match="has versions 1, 9"):
        registry.resolve_generator(*UNVERSIONED)  # neither is served: still ambiguous
