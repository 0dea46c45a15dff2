from __future__ import annotations

import math

import numpy as np
import pytest

from services.worker.sampling import check_sampling, sample_token, uniform_draw
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
