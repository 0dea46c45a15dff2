from __future__ import annotations

import math

import numpy as np
import pytest

from services.worker.sampling import (
    check_sampling,
    processed_logits,
    sample,
    sample_token,
    uniform_draw,
    without_banned,
)
from services.worker.work import SamplingParams

LOGITS = np.log(np.array([0.05, 0.5, 0.3, 0.15]))


def test_greedy_takes_the_argmax_with_its_log_probability() -> None:
    token, logprob = sample_token(LOGITS, SamplingParams(), seed=0, index=0)
    assert token == 1 and logprob == pytest.approx(math.log(0.5))


def test_draw_depends_only_on_seed_and_index() -> None:
    assert uniform_draw(7, 3) == uniform_draw(7, 3)
    assert len({uniform_draw(7, i) for i in range(50)}) == 50
    assert uniform_draw(7, 3) != uniform_draw(8, 3)
    params = SamplingParams(temperature=1.0, seed=7)
    assert [sample_token(LOGITS, params, seed=7, index=i) for i in range(20)] == [
        sample_token(LOGITS, params, seed=7, index=i) for i in range(20)
    ]


def test_temperature_sampling_follows_the_distribution() -> None:
    params = SamplingParams(temperature=1.0)
    counts = np.bincount([sample_token(LOGITS, params, seed=11, index=i)[0] for i in range(4000)], minlength=4)
    np.testing.assert_allclose(counts / 4000, [0.05, 0.5, 0.3, 0.15], atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_the_mass_and_renormalizes() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.75)  # keeps 0.5 + 0.3
    draws = [sample_token(LOGITS, params, seed=3, index=i) for i in range(2000)]
    tokens = {t for t, _ in draws}
    assert tokens == {1, 2}
    logprob_of = dict(draws)
    assert logprob_of[1] == pytest.approx(math.log(0.5 / 0.8))
    assert logprob_of[2] == pytest.approx(math.log(0.3 / 0.8))
    only_top = {sample_token(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), seed=3, index=i)[0]
                for i in range(200)}
    assert only_top == {1}


def _reference_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """The smallest prefix of the vocabulary stably sorted by descending probability reaching top_p."""
    order = np.argsort(-probs, kind="stable")
    cumulative = np.cumsum(probs[order])
    return set(order[: int(np.searchsorted(cumulative, top_p * cumulative[-1])) + 1].tolist())


@pytest.mark.parametrize("case", range(12))
def test_top_p_keeps_what_a_stable_sort_of_the_vocabulary_keeps(case: int) -> None:
    rng = np.random.default_rng(case)
    # Rounded logits make ties, some at the cut's edge; a wide spread makes cuts past the first guess.
    logits = np.round(rng.normal(size=500) * (0.3 if case % 2 else 4.0), 1)
    top_p = float(rng.uniform(0.05, 0.95))
    probs = np.exp(logits - logits.max())
    expected = _reference_nucleus(probs / probs.sum(), top_p)
    mass = probs[sorted(expected)].sum() / probs.sum()
    params = SamplingParams(temperature=1.0, top_p=top_p)
    for index in range(300):
        drawn = sample(logits, params, seed=case, index=index)
        assert drawn.token_id in expected
        assert drawn.logprob == pytest.approx(math.log(probs[drawn.token_id] / probs.sum() / mass), rel=1e-9)


def test_ties_at_the_edge_of_top_p_keep_the_lower_ids() -> None:
    logits = np.log(np.array([0.1, 0.3, 0.2, 0.3, 0.1]))  # stably by probability: 1, 3, 2, 0, 4

    def drawn(top_p: float) -> set[int]:
        return {sample_token(logits, SamplingParams(temperature=1.0, top_p=top_p), seed=2, index=i)[0]
                for i in range(300)}

    assert drawn(0.25) == {1}  # of the two 0.3s, the lower id
    assert drawn(0.85) == {1, 3, 2, 0}  # of the two 0.1s, the lower id


def test_masked_tokens_are_never_drawn() -> None:
    logits = np.full(64, -np.inf)
    logits[[3, 10]] = [0.0, 0.5]
    for top_p in (1.0, 0.9):
        params = SamplingParams(temperature=1.0, top_p=top_p)
        assert {sample_token(logits, params, seed=1, index=i)[0] for i in range(300)} == {3, 10}


def test_low_temperature_concentrates_on_the_argmax() -> None:
    params = SamplingParams(temperature=0.05)
    assert {sample_token(LOGITS, params, seed=5, index=i)[0] for i in range(200)} == {1}


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        (SamplingParams(temperature=-0.1), "temperature must be a finite number >= 0"),
        (SamplingParams(temperature=float("nan")), "temperature must be a finite number >= 0"),
        (SamplingParams(temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
        (SamplingParams(temperature=1.0, seed=-1), "seed must be in [0, 2**64)"),
    ],
)
def test_invalid_sampling_parameters_are_rejected(params: SamplingParams, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_sampling(params)
    assert fragment in str(caught.value)


def _reference_log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    import torch

    scaled = torch.tensor(logits, dtype=torch.float64) / (temperature or 1.0)
    return torch.log_softmax(scaled, dim=-1).numpy()


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (0.7, 1.0), (1.3, 0.6)])
def test_logprobs_are_log_softmax_of_the_logits_over_temperature(temperature: float, top_p: float) -> None:
    logits = np.random.default_rng(0).normal(size=50) * 3
    reference = _reference_log_softmax(logits, temperature)
    params = SamplingParams(temperature=temperature, top_p=top_p, logprobs=True, top_logprobs=5)
    for index in range(10):
        drawn = sample(logits, params, seed=4, index=index)
        assert drawn.logprobs is not None and drawn.logprobs.token.token_id == drawn.token_id
        assert drawn.logprobs.token.logprob == pytest.approx(reference[drawn.token_id], abs=1e-9)
        expected_top = np.argsort(-reference, kind="stable")[:5]
        assert [t.token_id for t in drawn.logprobs.top] == expected_top.tolist()
        assert [t.logprob for t in drawn.logprobs.top] == pytest.approx(reference[expected_top].tolist(), abs=1e-9)


def test_top_logprobs_break_ties_by_lower_token_id() -> None:
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0])
    drawn = sample(logits, SamplingParams(logprobs=True, top_logprobs=4), seed=0, index=0)
    assert drawn.logprobs is not None and [t.token_id for t in drawn.logprobs.top] == [1, 3, 2, 4]


def test_logprobs_change_nothing_about_the_draw_and_are_absent_unless_asked() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9)
    asked = SamplingParams(temperature=0.9, top_p=0.9, logprobs=True)
    for index in range(30):
        plain, with_logprobs = sample(LOGITS, params, seed=9, index=index), sample(LOGITS, asked, seed=9, index=index)
        assert (plain.token_id, plain.logprob) == (with_logprobs.token_id, with_logprobs.logprob)
        assert plain.logprobs is None and with_logprobs.logprobs is not None
        assert with_logprobs.logprobs.top == ()


def test_too_many_top_logprobs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"top_logprobs must be in \[0, 20\], got 21"):
        check_sampling(SamplingParams(logprobs=True, top_logprobs=21))


def test_penalties_follow_vllms_definitions() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0])
    tokens = [0, 1, 3, 3, 1]  # prompt 0, 1, 3; output 3, 1
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias=((4, 10.0),))
    expected = logits.copy()
    expected[4] += 10.0  # bias first
    expected[[0, 3]] /= 2.0  # repetition: every token of prompt and output, positive logits divided...
    expected[1] *= 2.0  # ...negative ones multiplied
    expected[3] -= 0.25 * 1 + 0.5  # presence and frequency over the output only
    expected[1] -= 0.25 * 1 + 0.5
    np.testing.assert_allclose(processed_logits(logits, params, tokens, num_generated=2), expected)
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -2.0], "the caller's logits are left as they were"


def test_frequency_penalty_counts_each_occurrence_in_the_output() -> None:
    logits = np.zeros(4)
    out = processed_logits(logits, SamplingParams(frequency_penalty=1.5), [2, 2, 2, 1], num_generated=3)
    assert out.tolist() == [0.0, -1.5, -3.0, 0.0]  # the output is [2, 2, 1]: the prompt's 2 is not counted


def test_logit_bias_forces_and_bans_tokens_and_logprobs_see_it() -> None:
    forced = SamplingParams(temperature=1.0, logit_bias=((0, 100.0),), logprobs=True)
    drawn = [sample(processed_logits(LOGITS, forced), forced, seed=1, index=i) for i in range(50)]
    assert {d.token_id for d in drawn} == {0}
    assert drawn[0].logprobs is not None and drawn[0].logprobs.token.logprob == pytest.approx(0.0, abs=1e-9)
    banned = SamplingParams(logit_bias=((1, -100.0),))
    assert sample(processed_logits(LOGITS, banned), banned, seed=0, index=0).token_id == 2


@pytest.mark.parametrize(("params", "fragment"), [
    (SamplingParams(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2]"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty must be in (0, 2]"),
    (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias[3] must be in [-100, 100]"),
])
def test_invalid_penalties_are_rejected(params: SamplingParams, fragment: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_sampling(params)
    assert fragment in str(caught.value)


# vLLM's top_k and min_p: cut after the temperature, min_p first, then top_k, then top_p over the rest.
CUT_LOGITS = np.log(np.array([0.05, 0.4, 0.25, 0.15, 0.15]))


def _drawn(params: SamplingParams, draws: int = 400) -> set[int]:
    return {sample_token(CUT_LOGITS, params, seed=3, index=i)[0] for i in range(draws)}


def test_top_k_keeps_the_k_most_likely_and_every_token_tied_with_the_kth() -> None:
    assert _drawn(SamplingParams(temperature=1.0, top_k=1)) == {1}
    assert _drawn(SamplingParams(temperature=1.0, top_k=2)) == {1, 2}
    assert _drawn(SamplingParams(temperature=1.0, top_k=3)) == {1, 2, 3, 4}, "3 and 4 tie at the third place"
    assert _drawn(SamplingParams(temperature=1.0, top_k=5)) == _drawn(SamplingParams(temperature=1.0)) == set(range(5))
    token, logprob = sample_token(CUT_LOGITS, SamplingParams(temperature=1.0, top_k=2), seed=3, index=0)
    assert logprob == pytest.approx(math.log({1: 0.4, 2: 0.25}[token] / 0.65)), "under the cut distribution"


def test_min_p_drops_tokens_below_that_share_of_the_most_likely() -> None:
    assert _drawn(SamplingParams(temperature=1.0, min_p=0.5)) == {1, 2}  # 0.25 >= 0.5 * 0.4 > 0.15
    assert _drawn(SamplingParams(temperature=1.0, min_p=1.0)) == {1}
    # Against the tempered distribution: at temperature 2 the shares flatten and 0.15 passes 0.5 x max.
    assert _drawn(SamplingParams(temperature=2.0, min_p=0.5)) == {1, 2, 3, 4}


def test_the_cuts_combine_in_vllms_order_and_greedy_ignores_them() -> None:
    # min_p 0.3 keeps {1, 2, 3, 4}; top_k 3 keeps them all (3 and 4 tie); top_p 0.6 of what is left
    # (0.95 x 0.6 = 0.57) needs 1 and 2 (0.65).
    assert _drawn(SamplingParams(temperature=1.0, min_p=0.3, top_k=3, top_p=0.6)) == {1, 2}
    assert sample_token(CUT_LOGITS, SamplingParams(top_k=3, min_p=0.9), seed=3, index=0)[0] == 1


@pytest.mark.parametrize("params", [SamplingParams(top_k=-1), SamplingParams(min_p=1.5),
                                    SamplingParams(min_p=float("nan"))])
def test_a_top_k_or_min_p_no_distribution_can_be_cut_by_is_refused(params: SamplingParams) -> None:
    with pytest.raises(ValueError, match="top_k must be >= 0 and min_p in"):
        check_sampling(params)


def test_banned_ids_are_never_drawn_unless_they_are_all_there_is():
    logits = np.array([0.0, 5.0, 1.0, 4.0])
    kept = without_banned(logits, (1, 3))
    assert sample(kept, SamplingParams(), seed=0, index=0).token_id == 2
    assert logits[1] == 5.0, "the caller's row is left as it was"
    drawn = {sample(kept, SamplingParams(temperature=2.0), seed=0, index=i).token_id for i in range(200)}
    assert drawn == {0, 2}
    masked = np.array([-np.inf, 3.0, -np.inf])  # a grammar that allows only the end (id 1)
    assert without_banned(masked, (1,)) is masked
