"""bench_embeddings' pure parts: the in-process side's prefill steps and a closed loop's figures."""

from __future__ import annotations

import pytest

from bench.worker.embed_plan import Chunk, Level, Sent, prefill_steps, requests_each


def test_prompts_that_fit_share_one_step():
    assert prefill_steps([3, 4, 5], budget=16, max_seqs=8) == [(Chunk(0, 0, 3), Chunk(1, 0, 4), Chunk(2, 0, 5))]


def test_a_prompt_the_budget_cuts_continues_first_in_the_next_step():
    assert prefill_steps([6, 7, 2], budget=8, max_seqs=8) == [
        (Chunk(0, 0, 6), Chunk(1, 0, 2)),
        (Chunk(1, 2, 7), Chunk(2, 0, 2)),
    ]


def test_a_prompt_longer_than_the_budget_takes_several_whole_steps():
    assert prefill_steps([20, 1], budget=8, max_seqs=8) == [
        (Chunk(0, 0, 8),), (Chunk(0, 8, 16),), (Chunk(0, 16, 20), Chunk(1, 0, 1))]


def test_max_seqs_caps_the_prompts_of_a_step():
    assert prefill_steps([1, 1, 1], budget=100, max_seqs=2) == [(Chunk(0, 0, 1), Chunk(1, 0, 1)), (Chunk(2, 0, 1),)]


def test_every_position_is_computed_once_in_order():
    lengths = [37, 250, 1, 128, 64, 200, 33]
    seen: dict[int, int] = {}
    for step in prefill_steps(lengths, budget=100, max_seqs=4):
        assert sum(c.end - c.start for c in step) <= 100 and len(step) <= 4
        for c in step:
            assert c.start == seen.get(c.index, 0) and c.end > c.start
            seen[c.index] = c.end
    assert seen == dict(enumerate(lengths))


@pytest.mark.parametrize(("lengths", "budget", "max_seqs"), [([0], 8, 8), ([3], 0, 8), ([3], 8, 0)])
def test_refuses_an_empty_prompt_or_a_zero_limit(lengths, budget, max_seqs):
    with pytest.raises(ValueError):
        prefill_steps(lengths, budget, max_seqs)


def test_requests_each_spreads_the_inputs_over_the_clients_at_least_one_each():
    assert requests_each(clients=4, batch=1, inputs_in_all=128) == 32
    assert requests_each(clients=4, batch=8, inputs_in_all=128) == 4
    assert requests_each(clients=4, batch=32, inputs_in_all=64) == 1


def test_a_level_counts_inputs_and_tokens_over_its_wall_time_and_flags_a_busy_generator():
    sent = (Sent(1.0, 0.01, 8, 800), Sent(1.0, 0.01, 8, 800), Sent(3.0, 0.2, 8, 800))
    level = Level(clients=2, batch=8, wall_s=4.0, sent=sent, load_average_1m=1.0, generator_cpu_s=0.4)
    assert (level.embeddings_per_s, level.tokens_per_s, level.p50_s, level.p99_s) == (6.0, 600.0, 1.0, 3.0)
    assert level.fell_behind  # 0.2 s of its own work against a 1 s median request
    calm = Level(2, 8, 4.0, sent[:2], 1.0, 0.4, (("gateway", 0.2), ("worker", 1.4)))
    assert not calm.fell_behind
    summary = calm.summary()
    assert summary["generator"]["cpu_share_of_one_core"] == pytest.approx(0.1)
    assert summary["server_cpu_cores"] == {"gateway": pytest.approx(0.05), "worker": pytest.approx(0.35)}
    assert calm.tokens_per_server_cpu_s == pytest.approx(1000.0)  # 1600 tokens over 1.6 CPU seconds
