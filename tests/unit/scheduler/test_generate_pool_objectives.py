"""A new stream's TTFT target at the scheduler: the routed worker if it is predicted to meet it, else
refused at once (GeneratePool.submit with ttft_target_s). Fake clock: each fake step takes 10 ms."""

from __future__ import annotations

import math
import re

import pytest

from services.common import errors
from services.common.priority import Priority
from services.scheduler.call_codec import prediction_factor
from services.scheduler.config import SchedulerConfig
from services.scheduler.fair_queue import TenantContext
from services.scheduler.generate_pool import GeneratePool
from services.scheduler.generate_stream import GenerateStream
from services.scheduler.sequence import SamplingParams
from services.scheduler.worker_link import WorkerLink
from tests.unit.scheduler.test_generate_pool import MODEL, Reader, attach, expected, hello
from tools.testbed.fake_clock import FakeClock

STEP_S = 0.010


@pytest.fixture(name="pool")
def _pool() -> GeneratePool:
    clock = FakeClock(autojump_turns=200)  # the first step after an idle spell waits a little (StepPacing.gather)
    return GeneratePool(MODEL, hello("w0"), SchedulerConfig(), clock=clock, sleep=clock.sleep)


def _submit(pool: GeneratePool, prompt: str, max_tokens: int, ttft_target_s: float | None,
            tpot_target_s: float | None = None, factor: float = 1.0) -> Reader:
    stream = GenerateStream(seq_id=WorkerLink.next_id(), tenant=TenantContext("t"), seed=0, trace_context={},
                            arrival_s=pool.clock(), deadline_s=None)
    pool.submit(stream, tuple(prompt.encode()), SamplingParams(max_tokens=max_tokens), ttft_target_s=ttft_target_s,
                tpot_target_s=tpot_target_s, ttft_prediction_factor=factor)
    return Reader(stream)


async def _warmed(pool: GeneratePool) -> None:
    attach(pool, "w1", step_s=STEP_S)
    reader = _submit(pool, "abc", 20, None)
    assert await reader.read() == expected("abc", 20)


async def test_a_target_below_one_step_alone_is_refused_at_once(pool):
    await _warmed(pool)
    with pytest.raises(errors.FailedPrecondition, match=r"TTFT target 2 ms cannot be met by model toy-generator:1: "
                                                         r"one step alone takes 10\.0 ms"):
        _submit(pool, "abc", 4, 0.002)
    assert pool.queue_depth == 0, "never queued"


async def test_a_tpot_target_below_one_step_alone_is_refused_at_once(pool):
    await _warmed(pool)
    with pytest.raises(errors.FailedPrecondition, match=r"TPOT target 4 ms cannot be met by model toy-generator:1: "
                                                         r"one step alone takes 10\.0 ms"):
        _submit(pool, "abc", 4, 1.0, tpot_target_s=0.004)
    assert pool.queue_depth == 0, "never queued"
    served = _submit(pool, "abc", 4, 1.0, tpot_target_s=0.050)
    assert await served.read() == expected("abc", 4)


async def test_a_stream_predicted_to_miss_behind_a_backlog_is_refused_with_a_hint_and_a_looser_one_admitted(pool):
    await _warmed(pool)
    backlog = [_submit(pool, "x" * 60, 2, None) for _ in range(10)]  # ~10 steps of prefill queued
    with pytest.raises(errors.ResourceExhausted, match=r"would start this stream in \d+ ms at best, past its TTFT "
                                                        r"target 50 ms; retry after") as caught:
        _submit(pool, "abc", 4, 0.050)
    assert caught.value.retry_after_s is not None and caught.value.retry_after_s >= 0.05
    admitted = _submit(pool, "abc", 4, 1.0)
    assert await admitted.read() == expected("abc", 4)
    for reader in backlog:
        await reader.read()


async def test_predictions_are_judged_times_the_gateway_s_factor_below_one_only(pool):
    """The gateway judged the stream on its correction of the predictions (ScheduleGenerateRequest.
    ttft_prediction_factor). Below 1 the check here judges the same way, so it does not refuse what the gateway
    found its streams beat; above 1 it keeps its own prediction (a backstop for a queue grown since the poll, not
    a second judgement by a factor another scheduler's streams taught)."""
    await _warmed(pool)
    backlog = [_submit(pool, "x" * 60, 2, None) for _ in range(10)]
    with pytest.raises(errors.ResourceExhausted) as caught:
        _submit(pool, "abc", 4, 0.050)
    raw_s = int(re.search(r"in (\d+) ms", str(caught.value)).group(1)) / 1000
    admitted = _submit(pool, "abc", 4, 0.050, factor=0.040 / raw_s)
    not_tightened = _submit(pool, "abc", 4, 1.0, factor=2.0 / raw_s)
    assert await admitted.read() == expected("abc", 4)
    assert await not_tightened.read() == expected("abc", 4)
    for reader in backlog:
        await reader.read()


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_a_factor_that_is_no_multiplier_is_invalid_and_an_unset_one_is_one(bad):
    with pytest.raises(errors.InvalidArgument, match=r"ttft_prediction_factor must be a finite number >= 0"):
        prediction_factor(bad)
    assert prediction_factor(0.0) == 1.0 and prediction_factor(0.7) == 0.7


async def test_with_nothing_waiting_a_prompt_longer_than_its_target_is_served_not_refused_as_overloaded(pool):
    """No stream waits on the worker, so this one starts on its next steps: its own prefill past the target is no
    overload, and a retry would fare no better. A backlog makes the same request a refusal again."""
    await _warmed(pool)
    prompt = "y" * 120  # two steps of prefill: predicted past the 15 ms target with nothing ahead of it
    (scheduler,) = (loop.scheduler for loop in pool._loops.values())
    assert scheduler.predicted_latency(Priority.STANDARD, len(prompt)).ttft_s > 0.015
    served = _submit(pool, prompt, 2, 0.015)
    assert await served.read() == expected(prompt, 2)
    backlog = [_submit(pool, "x" * 60, 2, None) for _ in range(10)]
    with pytest.raises(errors.ResourceExhausted, match=r"past its TTFT target 15 ms; retry after"):
        _submit(pool, prompt, 2, 0.015)
    for reader in backlog:
        await reader.read()
