"""A sequence runs only on a worker that declared what its steps rely on (WorkerHello.features): a
grammar that waits for the think block never reaches an older worker, which would ignore it and
constrain from the first token. Fake workers of test_generate_pool, older (no features) and newer."""

from __future__ import annotations

import dataclasses

import pytest

from services.common import errors
from services.common.grammar_after_reasoning import GrammarAfterReasoning
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.worker_features import WorkerFeature, needed_features
from services.scheduler.worker_link import WorkerLink
from tests.unit.scheduler.test_generate_pool import FakeWorker, Reader, _settle, detach, expected, hello
from tests.unit.scheduler.test_generate_pool import pool as pool  # noqa: F401  (the fixture)

WAITING = SamplingParams(max_tokens=20, grammar='start: "x"', grammar_after_reasoning=GrammarAfterReasoning(7))
HELD_WHOLE = dataclasses.replace(WAITING, grammar_after_reasoning=None)
ALL_FEATURES = frozenset(WorkerFeature)
STRUCTURED_ONLY = frozenset({WorkerFeature.STRUCTURED_OUTPUT})


def attach(pool: GeneratePool, worker_id: str, features: frozenset[WorkerFeature] = frozenset(),
           step_s: float = 0.001) -> FakeWorker:
    link = WorkerLink(dataclasses.replace(hello(worker_id), features=features))
    pool.add_worker(link)
    return FakeWorker(link, pool.clock, step_s)


def submit(pool: GeneratePool, prompt: str, sampling: SamplingParams = WAITING) -> Reader:
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"), seed=0, trace_context={},
                            arrival_s=pool.clock(), deadline_s=None)
    pool.submit(stream, tuple(prompt.encode()), sampling)
    return Reader(stream)


def test_a_grammar_needs_structured_output_and_one_that_waits_for_the_reasoning_needs_both():
    assert needed_features(WAITING) == ALL_FEATURES
    assert needed_features(HELD_WHOLE) == {WorkerFeature.STRUCTURED_OUTPUT}
    assert needed_features(SamplingParams(max_tokens=4, logprobs=True)) == frozenset()


async def test_with_an_older_and_a_newer_worker_a_waiting_grammar_runs_only_on_the_newer(pool):
    old = attach(pool, "old")
    new = attach(pool, "new", ALL_FEATURES)
    assert pool.honours(WorkerFeature.GRAMMAR_AFTER_REASONING)
    readers = [submit(pool, prompt) for prompt in ("abc", "def", "ghi", "jkl")]
    for reader, prompt in zip(readers, ("abc", "def", "ghi", "jkl"), strict=True):
        assert await reader.read() == expected(prompt, 20)
    assert old.num_steps == 0 and new.num_steps > 0


async def test_an_older_worker_still_takes_what_needs_no_feature(pool):
    attach(pool, "new", ALL_FEATURES)
    old = attach(pool, "old")
    plain = SamplingParams(max_tokens=20)
    readers = [submit(pool, prompt, plain) for prompt in ("abc", "def", "ghi", "jkl")]
    for reader in readers:
        await reader.read()
    assert old.num_steps > 0, "least loaded routing spreads plain sequences over both"


async def test_with_only_older_workers_a_grammar_is_refused_naming_what_none_honours(pool):
    attach(pool, "old")
    assert not pool.honours(WorkerFeature.STRUCTURED_OUTPUT)
    with pytest.raises(errors.Unavailable) as refused:
        submit(pool, "abc", HELD_WHOLE)
    assert str(refused.value) == ("no worker of model toy-generator:1 honours sampling.structured "
                                  "(WORKER_FEATURE_STRUCTURED_OUTPUT): its workers are older than this scheduler, "
                                  "or sample without it")


async def test_a_worker_that_masks_only_from_the_first_token_takes_a_grammar_not_a_waiting_one(pool):
    worker = attach(pool, "masks", STRUCTURED_ONLY)
    assert pool.honours(WorkerFeature.STRUCTURED_OUTPUT) and not pool.honours(WorkerFeature.GRAMMAR_AFTER_REASONING)
    assert await submit(pool, "abc", HELD_WHOLE).read() == expected("abc", 20) and worker.num_steps > 0
    with pytest.raises(errors.Unavailable, match=r"honours a grammar after the reasoning "
                                                 r"\(WORKER_FEATURE_GRAMMAR_AFTER_REASONING\):"):
        submit(pool, "abc")


async def test_a_waiting_grammar_is_held_rather_than_moved_to_an_older_worker(pool):
    new = attach(pool, "new", ALL_FEATURES, step_s=0.005)
    old = attach(pool, "old")
    reader = submit(pool, "xyz")
    head = await reader.read(until_tokens=5)
    detach(pool, new)
    await _settle()
    assert pool.queue_depth == 1 and old.num_steps == 0, "held, not recomputed on the older worker"
    attach(pool, "newer", ALL_FEATURES)
    tail = await reader.read()
    assert head + tail == expected("xyz", 20) and old.num_steps == 0


async def test_a_draining_worker_keeps_the_waiting_grammars_no_other_worker_may_take(pool):
    new = attach(pool, "new", ALL_FEATURES)
    old = attach(pool, "old")
    prompts = [f"{chr(ord('a') + n)}bc" for n in range(10)]  # more than max_num_seqs: some wait
    readers = [submit(pool, prompt) for prompt in prompts]
    new.link.draining = True  # its Draining message
    pool.drain_worker(new.link)
    for reader, prompt in zip(readers, prompts, strict=True):
        assert await reader.read() == expected(prompt, 20)
    assert old.num_steps == 0 and pool.queue_depth == 0
