"""Prefix caching on real processes: schedulers with the cache on and off, each with a tinylm
worker of few KV blocks.

Greedy streams must be token for token the same with the cache on and off, while prompts
sharing prefixes interleave and sequences are preempted; with it on, the scheduler reuses
blocks (hit tokens counted) but never across tenants, unless the prefix is marked public.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass

import pytest

from infermesh.v1 import common_pb2, gateway_pb2, scheduler_pb2
from tools.testbed.gateway_fixtures import Metrics, scrape
from tools.testbed.processes import Mesh, free_port, running_mesh
from tools.testbed.scheduler_fixtures import (
    read_stream,
    scheduler_stub,
    tenant,
    wait_for_idle_kv,
    wait_for_workers,
)

pytestmark = pytest.mark.integration

TINYLM = common_pb2.ModelRef(name="tinylm")
SYSTEM = ("You are a careful assistant. Answer in one short sentence. ",
          "def add(a, b):\n    return a + b\n\n# Explain the function above: ")
QUESTIONS = ("What is Python?", "Why tests?", "Name a list.", "How do loops work?")
# Marked public on the "on" scheduler, and sent only by the isolation test.
PUBLIC = "Public notice: the library opens at nine. Q: "
NUM_TOKENS = 16


@dataclass
class Scheduler:
    mesh: Mesh
    metrics_port: int

    def counters(self) -> Metrics:
        """The scheduler's metrics; `.value(name)` sums a counter over workers."""
        return scrape(self.metrics_port)


@pytest.fixture(scope="module")
def schedulers(tmp_path_factory):
    """'on' and 'off', each a scheduler and one tinylm worker of 24 blocks of 16 tokens (the eight
    ~90-token sequences of a round need more, so some are preempted); the workers load together."""
    with contextlib.ExitStack() as stack:
        found: dict[str, Scheduler] = {}
        workers = []
        for name, args in (("on", ("--public-prefixes", json.dumps([PUBLIC]))), ("off", ("--prefix-cache", "off"))):
            mesh = stack.enter_context(running_mesh(tmp_path_factory.mktemp(f"prefix-cache-{name}")))
            found[name] = Scheduler(mesh, free_port())
            mesh.start_scheduler("--metrics-port", str(found[name].metrics_port), *args)
            workers.append(mesh.start_worker("tinylm", "--num-kv-blocks", "24", wait=False))
        for worker in workers:
            worker.wait_serving()
        for scheduler in found.values():
            with scheduler_stub(scheduler.mesh.scheduler.address) as stub:
                wait_for_workers(stub, TINYLM, 1)
        yield found


def _request(prompt: str, who: str) -> scheduler_pb2.ScheduleGenerateRequest:
    return scheduler_pb2.ScheduleGenerateRequest(
        request=gateway_pb2.GenerateRequest(model=TINYLM, prompt=prompt,
                                            sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS)),
        tenant=tenant(who))


def _run_interleaved(scheduler: Scheduler) -> dict[tuple[str, str], str]:
    """Every (tenant, prompt) at once: each stream's text."""
    prompts = [system + question for system in SYSTEM for question in QUESTIONS]
    texts: dict[tuple[str, str], str] = {}
    with scheduler_stub(scheduler.mesh.scheduler.address) as stub:
        def run(who: str, prompt: str) -> None:
            texts[(who, prompt)] = read_stream(stub.Generate(_request(prompt, who), timeout=60)).text

        threads = [threading.Thread(target=run, args=(who, p)) for who in ("acme", "globex") for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        wait_for_idle_kv(stub, TINYLM)
    return texts


def test_greedy_streams_are_the_same_with_the_cache_on_and_off_under_preemption(schedulers):
    cached = _run_interleaved(schedulers["on"])
    computed = _run_interleaved(schedulers["off"])
    assert len(cached) == 2 * len(SYSTEM) * len(QUESTIONS)
    assert cached == computed
    assert all(len(text) > 0 for text in cached.values())
    on, off = schedulers["on"].counters(), schedulers["off"].counters()
    assert on.value("infermesh_scheduler_preemptions_total") >= 1
    assert on.value("infermesh_scheduler_prefix_cache_hit_tokens_total") > 0.3 * on.value(
        "infermesh_scheduler_prefix_cache_queried_tokens_total")
    assert on.value("infermesh_scheduler_prefix_cache_evictions_total") > 0
    assert off.value("infermesh_scheduler_prefix_cache_hit_tokens_total") == 0


def test_a_tenant_reuses_only_its_own_blocks_unless_the_prefix_is_public(schedulers):
    scheduler = schedulers["on"]
    with scheduler_stub(scheduler.mesh.scheduler.address) as stub:
        def hits_of(prompt: str, who: str) -> float:
            before = scheduler.counters().value("infermesh_scheduler_prefix_cache_hit_tokens_total")
            *_, last = stub.Generate(_request(prompt, who), timeout=30)
            wait_for_idle_kv(stub, TINYLM)
            hits = scheduler.counters().value("infermesh_scheduler_prefix_cache_hit_tokens_total") - before
            assert last.chunk.usage.cached_prompt_tokens == hits, "the usage reports what the cache held"
            return hits

        private = "Translate into French, please: good morning"  # BOS + 43 bytes: 2 full blocks reusable
        assert hits_of(private, "acme") == 0
        assert hits_of(private, "globex") == 0  # the same tokens, another tenant: computed again
        assert hits_of(private, "acme") == 32
        shared = PUBLIC + "When?"  # BOS + 50 bytes; the public prefix (BOS + 45) holds 2 full blocks
        assert hits_of(shared, "acme") == 0
        assert hits_of(shared, "globex") == 32  # the public blocks only; acme's after them are its own
        assert hits_of(shared, "globex") == 48
