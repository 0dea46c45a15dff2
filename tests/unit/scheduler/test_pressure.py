from __future__ import annotations

import pytest

from services.scheduler import call_codec
from services.scheduler.attach_types import ModelKey
from services.scheduler.fair_queue import Priority
from services.scheduler.pressure import MAX_QUEUE_TIME_S, classifier_pressure, generator_pressure

from .conftest import FakePagedWorker, make_batcher, make_requests, make_scheduler, run_steps, tenant


def test_classifier_queue_time_grows_with_the_backlog_of_its_class_and_above(clock):
    batcher = make_batcher(clock, workers={"w1": 4}, max_queue_size=100, initial_batch_time_s=0.010)
    idle = classifier_pressure(batcher)
    assert idle.est_queue_time_s[Priority.STANDARD] == pytest.approx(0.0)
    for i in range(40):
        batcher.submit(i, tenant("bulk", Priority.SHEDDABLE), deadline_s=None)
    for i in range(8):
        batcher.submit(i, tenant("app", Priority.STANDARD), deadline_s=None)
    busy = classifier_pressure(batcher)
    assert busy.queue_depth == 48 and busy.num_workers == 1 and busy.kv_usage == 0.0
    assert busy.est_queue_time_s[Priority.CRITICAL] == pytest.approx(0.0)
    assert busy.est_queue_time_s[Priority.STANDARD] == pytest.approx(0.020)  # two batches of 4 ahead
    assert busy.est_queue_time_s[Priority.SHEDDABLE] == pytest.approx(0.120)
    assert busy.min_service_time_s == pytest.approx(0.010)
    assert busy.num_slots == 8  # a batch of 4 running and one prefetched


def test_wire_form_is_microseconds_indexed_by_priority_value(clock):
    batcher = make_batcher(clock, workers={"w1": 4}, initial_batch_time_s=0.010)
    for i in range(4):
        batcher.submit(i, tenant(), deadline_s=None)
    assert classifier_pressure(batcher).est_queue_time_us_by_priority() == [0, 0, 10_000, 10_000]


def test_classifier_without_workers_reports_the_capped_maximum(clock):
    pressure = classifier_pressure(make_batcher(clock, workers={}))
    assert pressure.num_workers == 0
    assert set(pressure.est_queue_time_s.values()) == {MAX_QUEUE_TIME_S}


def test_generator_pressure_sums_kv_usage_and_waiting_over_workers(clock):
    busy = make_scheduler(clock, num_blocks=64, max_num_seqs=2)
    idle = make_scheduler(clock, num_blocks=64)
    make_requests(busy, 5, prompt_len=16)
    run_steps(busy, FakePagedWorker(4), clock, max_steps=1)
    pressure = generator_pressure([busy, idle])
    assert pressure.num_workers == 2
    assert pressure.num_slots == 3 + idle.config.max_num_seqs * 3 // 2  # running + half as many waiting
    assert pressure.queue_depth == 3
    assert pressure.kv_usage == pytest.approx(8 / 128)
    assert pressure.est_queue_time_s[Priority.STANDARD] == 0.0  # the idle worker takes it
    assert busy.estimated_queue_time_s(Priority.STANDARD) > 0
    assert generator_pressure([]).est_queue_time_s[Priority.CRITICAL] == MAX_QUEUE_TIME_S


def test_generator_pressure_predicts_ttft_from_the_tokens_queued_ahead_of_each_class(clock):
    scheduler = make_scheduler(clock, num_blocks=64, max_num_seqs=8)  # slots for all: tokens decide
    run_steps(scheduler, FakePagedWorker(4), clock, max_steps=0)
    idle = generator_pressure([scheduler])
    # Nothing queued: one step of a one-token prompt, at the configured step time before any was measured.
    assert idle.predicted_ttft_s[Priority.SHEDDABLE] == pytest.approx(scheduler.config.initial_step_time_s)
    make_requests(scheduler, 6, prompt_len=16, who=tenant("bulk", Priority.SHEDDABLE))
    busy = generator_pressure([scheduler])
    assert busy.predicted_ttft_s[Priority.CRITICAL] == idle.predicted_ttft_s[Priority.CRITICAL]
    # 96 prompt tokens ahead + 1 at 32 tokens a step: 4 steps.
    assert busy.predicted_ttft_s[Priority.SHEDDABLE] == pytest.approx(4 * scheduler.config.initial_step_time_s)
    assert busy.predicted_ttft_us_by_priority()[Priority.SHEDDABLE] == round(
        busy.predicted_ttft_s[Priority.SHEDDABLE] * 1e6)


def test_generator_pressure_predicts_ttft_from_the_slots_when_they_are_full(clock):
    scheduler = make_scheduler(clock, num_blocks=64, max_num_seqs=2)
    make_requests(scheduler, 6, prompt_len=16, max_tokens=8, who=tenant("bulk", Priority.SHEDDABLE))
    busy = generator_pressure([scheduler])
    # Two slots, six ahead of 8 tokens each: they take them in three turns, a slot frees after 24 steps.
    assert busy.predicted_ttft_s[Priority.SHEDDABLE] == pytest.approx(25 * scheduler.config.initial_step_time_s)
    assert busy.predicted_ttft_s[Priority.CRITICAL] == pytest.approx(scheduler.config.initial_step_time_s)


def test_generator_pressure_reports_how_its_prediction_grows_per_stream_queued_spread_over_the_workers(clock):
    def full(first_id: int):
        scheduler = make_scheduler(clock, num_blocks=64, max_num_seqs=2)
        make_requests(scheduler, 6, prompt_len=16, max_tokens=8, first_id=first_id, who=tenant("bulk", Priority.SHEDDABLE))
        return scheduler

    one = full(1)
    alone = generator_pressure([one])
    assert alone.ttft_per_queued_s[Priority.SHEDDABLE] == pytest.approx(one.ttft_per_queued_s(Priority.SHEDDABLE))
    assert alone.ttft_per_queued_s[Priority.SHEDDABLE] > 0
    assert alone.ttft_per_queued_us_by_priority()[Priority.SHEDDABLE] == round(
        alone.ttft_per_queued_s[Priority.SHEDDABLE] * 1e6)
    two = generator_pressure([one, full(101)])  # two such workers: each takes half of what is admitted
    assert two.ttft_per_queued_s[Priority.SHEDDABLE] == pytest.approx(alone.ttft_per_queued_s[Priority.SHEDDABLE] / 2)


def test_generator_pressure_reports_what_each_token_of_a_stream_s_own_prompt_adds_to_its_ttft(clock):
    scheduler = make_scheduler(clock, num_blocks=64, max_num_seqs=8)  # 32 tokens a step, nothing running
    pressure = generator_pressure([scheduler])
    # A prompt of 33 tokens takes two steps where one token takes one: one step per 32 tokens.
    assert pressure.ttft_per_prompt_token_s == pytest.approx(scheduler.config.initial_step_time_s / 32)
    assert scheduler.predicted_latency(Priority.CRITICAL, 33).ttft_s == pytest.approx(
        pressure.predicted_ttft_s[Priority.CRITICAL] + 32 * pressure.ttft_per_prompt_token_s)
    wire = call_codec.encode_pressure(ModelKey("gen", "1"), pressure)
    assert wire.ttft_per_prompt_token_ns == round(pressure.ttft_per_prompt_token_s * 1e9)
    assert classifier_pressure(make_batcher(clock, workers={"w1": 4})).ttft_per_prompt_token_s == 0.0


def test_the_step_time_fit_learns_from_the_steps_run(clock):
    scheduler = make_scheduler(clock, num_blocks=64, max_num_seqs=4)
    make_requests(scheduler, 4, prompt_len=16)
    run_steps(scheduler, FakePagedWorker(4), clock, step_s=0.02)
    assert scheduler.latency.model.num_observed > 0
    assert scheduler.predicted_latency(Priority.STANDARD).tpot_s == pytest.approx(0.02, rel=0.05)
