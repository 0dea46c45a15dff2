"""LoRA adapters at the scheduler: each a model name resolving to its base with the adapter named, and
its blocks cached apart from the base's and every other adapter's."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import InvalidArgument, NotFound
from services.scheduler.attach_codec import decode_hello
from services.scheduler.config import SchedulerConfig
from services.scheduler.model_registry import ModelRegistry
from services.scheduler.prefix_cache import PrefixCacheKeys, cache_salt, tenant_salt
from services.scheduler.worker_link import WorkerLink
from services.worker.builtin_models import ToyGeneratorRuntime


@pytest.fixture
async def registry():
    yield ModelRegistry(SchedulerConfig())
    tasks = asyncio.all_tasks() - {asyncio.current_task()}  # the pools' dispatch loops
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _attach(registry: ModelRegistry, version: str, worker_id: str, adapters: tuple[str, ...]) -> WorkerLink:
    hello = ToyGeneratorRuntime(version).hello(worker_id)
    hello.lora_adapters.extend(adapters)
    link = WorkerLink(decode_hello(hello))
    registry.attach(link)
    return link


async def test_an_adapter_name_resolves_to_its_base_with_the_adapter(registry):
    _attach(registry, "1", "w1", ("sql", "chat"))
    entry, adapter = registry.resolve_generator_adapter("sql", "")
    assert (entry.key.name, entry.key.version, adapter) == ("toy-generator", "1", "sql")
    assert registry.resolve_generator_adapter("sql", "1")[1] == "sql"
    assert registry.resolve_generator_adapter("toy-generator", "")[1] == ""
    assert registry.adapters().keys() == {"sql", "chat"} and registry.knows("chat")


async def test_an_unknown_adapter_or_another_version_is_not_found_naming_it(registry):
    _attach(registry, "1", "w1", ("sql",))
    with pytest.raises(NotFound, match="'nope'"):
        registry.resolve_generator_adapter("nope", "")
    with pytest.raises(NotFound, match="sql"):
        registry.resolve_generator_adapter("sql", "2")


async def test_an_adapter_named_as_a_model_or_another_versions_adapter_is_refused(registry):
    _attach(registry, "1", "w1", ("sql",))
    with pytest.raises(InvalidArgument, match="'toy-generator'.*as a model"):
        _attach(registry, "1", "w2", ("toy-generator",))
    with pytest.raises(InvalidArgument, match="'sql'.*LoRA adapter of toy-generator:1"):
        _attach(registry, "2", "w3", ("sql",))


def test_adapter_blocks_are_salted_apart_from_the_base_and_each_other():
    assert cache_salt("t") == tenant_salt("t")
    assert len({cache_salt("t"), cache_salt("t", "a"), cache_salt("t", "b")}) == 3
    tokens = list(range(40))
    keys = PrefixCacheKeys.of([tokens[:32]])  # a public prefix: the base's blocks are shared by tenants
    base = keys.block_hashes(tokens, 16, "t")
    assert base == keys.block_hashes(tokens, 16, "u")
    a, b = keys.block_hashes(tokens, 16, "t", "a"), keys.block_hashes(tokens, 16, "t", "b")
    assert not {*a} & {*b} and not {*a} & {*base}
