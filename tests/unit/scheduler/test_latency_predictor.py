"""The online step-time fit and the TTFT / TPOT it predicts (scheduler/latency_predictor.py)."""

from __future__ import annotations

import pytest

from services.common.priority import Priority
from services.scheduler.latency_predictor import (
    MAX_HIGHER_SHARE,
    MAX_SIMULATED_WAITING,
    OUTLIER_RATIO,
    LatencyPredictor,
    StepCost,
    StepTimeModel,
    slot_shares,
    steps_until_slot,
    wait_stretch,
)


def _gpu_like(num_seqs: int, num_tokens: int) -> float:
    # 4 ms fixed, 0.2 ms per running sequence, 0.05 ms per computed token.
    return 0.004 + 0.0002 * num_seqs + 0.00005 * num_tokens


def _fed(batches, step_time=_gpu_like, **over) -> StepTimeModel:
    model = StepTimeModel(0.01, **over)
    for num_seqs, num_tokens in batches:
        model.observe(num_seqs, num_tokens, step_time(num_seqs, num_tokens))
    return model


MIXED = [(s, t) for s in (1, 4, 16, 32) for t in (s, s + 64, s + 480)] * 5


def test_the_fit_recovers_a_step_time_that_grows_with_batch_and_tokens():
    cost = _fed(MIXED).cost
    assert cost.base_s == pytest.approx(0.004, rel=1e-3)
    assert cost.per_seq_s == pytest.approx(0.0002, rel=1e-2)
    assert cost.per_token_s == pytest.approx(0.00005, rel=1e-2)


def test_before_any_step_the_configured_step_time_is_used():
    model = StepTimeModel(0.02)
    assert model.cost == StepCost(0.02, 0.0, 0.0)
    assert model.step_time_s(8, 100) == 0.02


def test_steps_all_alike_give_their_mean_not_a_wild_extrapolation():
    model = _fed([(8, 8)] * 50, step_time=lambda s, t: 0.012)
    assert model.step_time_s(8, 8) == pytest.approx(0.012, rel=1e-3)
    assert 0 <= model.step_time_s(1, 1) <= 0.012 * 1.01


def test_empty_or_badly_timed_steps_teach_nothing():
    model = StepTimeModel(0.01)
    model.observe(0, 0, 0.5)
    model.observe(4, 4, float("nan"))
    model.observe(4, 4, -1.0)
    assert model.num_observed == 0 and model.step_time_s(4, 4) == 0.01


def test_old_steps_are_forgotten_when_the_worker_slows_down():
    model = _fed(MIXED)
    for num_seqs, num_tokens in MIXED * 20:
        model.observe(num_seqs, num_tokens, 2 * _gpu_like(num_seqs, num_tokens))
    assert model.step_time_s(16, 16) == pytest.approx(2 * _gpu_like(16, 16), rel=0.05)


def _predictor() -> LatencyPredictor:
    return LatencyPredictor(_fed(MIXED), max_num_seqs=32, max_num_batched_tokens=512)


def test_ttft_is_the_steps_to_compute_what_is_ahead_and_the_own_prompt():
    predictor = _predictor()
    alone = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=100, num_running=0)
    assert alone.ttft_s == pytest.approx(_gpu_like(1, 100), rel=0.02)
    # 2000 tokens ahead + 100 own next to 12 decodes: 500 prefill tokens a step, 4 full steps and one of 100.
    queued = predictor.predict(num_tokens_ahead=2000, num_prompt_tokens=100, num_running=12)
    expected = 4 * _gpu_like(13, 512) + _gpu_like(13, 12 + 100)
    assert queued.ttft_s == pytest.approx(expected, rel=0.02)
    assert queued.tpot_s == pytest.approx(_gpu_like(13, 13), rel=0.02)


def test_more_running_sequences_mean_a_slower_token():
    predictor = _predictor()
    tpots = [predictor.predict(num_tokens_ahead=0, num_prompt_tokens=1, num_running=n).tpot_s for n in (0, 8, 31)]
    assert tpots == sorted(tpots) and tpots[0] < tpots[-1]


def test_the_least_possible_ttft_is_one_step_of_one_token():
    predictor = _predictor()
    assert predictor.min_ttft_s() == pytest.approx(_gpu_like(1, 1), rel=0.02)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="initial_step_time_s must be > 0"):
        StepTimeModel(0.0)
    with pytest.raises(ValueError, match="decay must be in"):
        StepTimeModel(0.01, decay=1.0)
    with pytest.raises(ValueError, match="must be >= 1"):
        LatencyPredictor(StepTimeModel(0.01), max_num_seqs=0, max_num_batched_tokens=8)


def test_a_constant_step_time_over_varied_batches_stays_constant_even_with_noise():
    jitter = iter([0.0004, -0.0003, 0.0001, -0.0002] * 100)
    model = _fed(MIXED, step_time=lambda s, t: 0.02 + next(jitter))
    cost = model.cost
    assert min(cost.base_s, cost.per_seq_s, cost.per_token_s) >= 0
    for num_seqs, num_tokens in ((1, 1), (32, 512)):
        assert model.step_time_s(num_seqs, num_tokens) == pytest.approx(0.02, rel=0.1)


def test_with_a_free_slot_a_newcomer_waits_for_no_one_to_finish():
    assert steps_until_slot(4, [10, 20, 30], []) == 0
    assert steps_until_slot(4, [], [5, 5, 5]) == 0


def test_with_every_slot_held_a_newcomer_waits_for_the_first_to_finish():
    assert steps_until_slot(3, [30, 10, 20], []) == 10


def test_sequences_queued_ahead_take_the_slots_that_free_first():
    # Slots free at 10, 20, 30; the two ahead take 10 (-> 15) and 15 (-> 55): the newcomer gets 20.
    assert steps_until_slot(3, [10, 20, 30], [5, 40]) == 20
    # A free slot is taken by the first one ahead, the next waits for the one at 10.
    assert steps_until_slot(2, [10], [8, 8]) == 10


def test_a_deep_queue_is_counted_by_its_mean_beyond_those_placed_one_by_one():
    num_slots = 4
    placed = steps_until_slot(num_slots, [0] * num_slots, [8] * MAX_SIMULATED_WAITING)
    assert placed == 8 * MAX_SIMULATED_WAITING // num_slots
    deeper = steps_until_slot(num_slots, [0] * num_slots, [8] * (MAX_SIMULATED_WAITING + 40))
    assert deeper == placed + 8 * 40 // num_slots


def test_ttft_counts_the_steps_until_a_slot_frees_at_the_decode_step_time():
    predictor = _predictor()
    # 31 running, one prompt token queued: tokens alone say one step; waiting 20 steps for a slot says more.
    by_tokens = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=31)
    by_slot = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=31, num_steps_to_slot=20)
    assert by_tokens.ttft_s == pytest.approx(_gpu_like(32, 31 + 10), rel=0.02)
    assert by_slot.ttft_s == pytest.approx(21 * _gpu_like(32, 31) + 10 * 0.00005, rel=0.02)


def test_a_smaller_token_budget_spreads_the_prefill_over_more_steps():
    predictor = _predictor()
    full = predictor.predict(num_tokens_ahead=900, num_prompt_tokens=100, num_running=12)
    paced = predictor.predict(num_tokens_ahead=900, num_prompt_tokens=100, num_running=12, token_budget=112)
    # 1000 prompt tokens at 500 a step: 2 steps; at 100 a step: 10 steps.
    assert full.ttft_s == pytest.approx(2 * _gpu_like(13, 12) + 1000 * 0.00005, rel=0.02)
    assert paced.ttft_s == pytest.approx(10 * _gpu_like(13, 12) + 1000 * 0.00005, rel=0.02)


def test_a_newcomer_waits_behind_the_steps_in_flight_the_oldest_half_done():
    predictor = _predictor()
    idle = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=8)
    behind_two = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=8, num_steps_in_flight=2)
    assert behind_two.ttft_s - idle.ttft_s == pytest.approx(1.5 * _gpu_like(9, 8), rel=0.02)


def test_higher_classes_holding_half_the_slots_double_the_wait_but_not_the_own_prefill():
    predictor = _predictor()
    alone = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=31, num_steps_to_slot=20)
    behind = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=31, num_steps_to_slot=20,
                               higher_share=0.5)
    # 20 steps waiting for a slot become 40; the one step computing its prompt stays one.
    assert behind.ttft_s - alone.ttft_s == pytest.approx(20 * _gpu_like(32, 31), rel=0.02)


def test_with_nothing_ahead_higher_classes_change_nothing():
    predictor = _predictor()
    free = predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=8)
    assert predictor.predict(num_tokens_ahead=0, num_prompt_tokens=10, num_running=8, higher_share=0.99) == free


def test_a_class_that_higher_ones_fill_every_slot_for_waits_the_capped_stretch():
    assert wait_stretch(0.0) == 1.0
    assert wait_stretch(0.75) == pytest.approx(4.0)
    assert wait_stretch(1.0) == wait_stretch(5.0) == pytest.approx(1 / (1 - MAX_HIGHER_SHARE))


def test_slot_shares_add_up_from_the_highest_class_and_stop_at_every_slot():
    shares = slot_shares(8, {Priority.CRITICAL: 2, Priority.STANDARD: 4, Priority.SHEDDABLE: 9})
    assert shares == {Priority.CRITICAL: 0.25, Priority.STANDARD: 0.75, Priority.SHEDDABLE: 1.0}


# -- robust to a freeze, still learning a shift ----------------------------------------------------


def _steady(model: StepTimeModel, num_steps: int, step_time_s: float) -> None:
    for index in range(num_steps):
        num_seqs = 4 + index % 5  # batches vary a little, as running sets do
        model.observe(num_seqs, num_seqs, step_time_s)


@pytest.mark.parametrize("frozen_batch", [(8, 8), (1, 1), (8, 300)])
def test_one_frozen_step_among_steady_ones_barely_moves_the_fit(frozen_batch):
    model = StepTimeModel(0.02)
    _steady(model, 200, 0.02)
    learned_s = model.observe(*frozen_batch, 5.0)  # a 5 s SIGSTOP of the worker mid-step
    assert learned_s is not None and learned_s <= OUTLIER_RATIO * 0.02 * 1.01
    # "One step alone" stays what it was, not a second: a lone step of an unusual batch set it before.
    assert model.step_time_s(1, 1) < 0.025
    assert model.step_time_s(8, 8) < 0.025
    _steady(model, 3, 0.02)
    assert model.step_time_s(1, 1) == pytest.approx(0.02, rel=0.1)


def test_a_freeze_early_on_is_bounded_too():
    model = StepTimeModel(0.02)
    _steady(model, 5, 0.009)
    model.observe(1, 1, 5.0)
    assert model.step_time_s(1, 1) < OUTLIER_RATIO * 0.009


def test_a_sustained_slowdown_is_learned_within_tens_of_steps():
    model = StepTimeModel(0.02)
    _steady(model, 300, 0.02)
    _steady(model, 20, 0.06)
    assert model.step_time_s(6, 6) == pytest.approx(0.06, rel=0.1)


def test_a_tenfold_slowdown_is_learned_as_measured_not_clipped_forever():
    model = StepTimeModel(0.02)
    _steady(model, 300, 0.02)
    _steady(model, 5, 0.2)
    assert model.step_time_s(6, 6) > 0.03  # the fifth slow step in a row is a shift, learned as measured
    _steady(model, 15, 0.2)
    assert model.step_time_s(6, 6) == pytest.approx(0.2, rel=0.15)


def test_a_sustained_speedup_is_learned_within_tens_of_steps():
    model = StepTimeModel(0.02)
    _steady(model, 300, 0.06)
    _steady(model, 25, 0.02)
    assert model.step_time_s(6, 6) == pytest.approx(0.02, rel=0.1)


def test_a_batch_the_fit_never_saw_is_still_learned_step_by_step():
    # Decodes only, then long prefills now and then: each is far above the decode-only fit, and the
    # clipped value it teaches raises the limit for the next, so the per-token cost is found.
    model = StepTimeModel(0.01)
    for _ in range(10):
        for _ in range(20):
            model.observe(8, 8, _gpu_like(8, 8))
        model.observe(8, 520, _gpu_like(8, 520))
    assert model.step_time_s(8, 520) == pytest.approx(_gpu_like(8, 520), rel=0.1)


def test_a_frozen_command_of_eight_steps_is_one_freeze_not_a_shift():
    model = StepTimeModel(0.02)
    _steady(model, 200, 0.02)
    for _ in range(8):  # 5 s over one command of 8 steps: each step's share, results back together
        model.observe(6, 6, 5.0 / 8, shared=True)
    assert model.step_time_s(6, 6) < 0.025
    # The same times measured step by step are five slow steps in a row: a shift, learned as measured.
    for _ in range(8):
        model.observe(6, 6, 5.0 / 8)
    assert model.step_time_s(6, 6) > 0.1
