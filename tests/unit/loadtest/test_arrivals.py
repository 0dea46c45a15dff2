import numpy as np
import pytest
from scipy import stats

from loadtest.arrivals import ArrivalProcess, RateSchedule, Segment, arrival_times_s


def _times(process, schedule, seed=11, burstiness=1.0) -> np.ndarray:
    return np.array(list(arrival_times_s(schedule, process, np.random.default_rng(seed), burstiness)))


def test_poisson_arrivals_have_the_target_rate_and_exponential_gaps():
    rate_rps = 50.0
    times = _times(ArrivalProcess.POISSON, RateSchedule.constant(rate_rps, 200.0))
    assert len(times) / 200.0 == pytest.approx(rate_rps, rel=0.03)
    gaps = np.diff(times)
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate_rps)).pvalue > 0.01
    # The test has power: the same gaps are clearly not gamma with shape 0.25.
    assert stats.kstest(gaps, "gamma", args=(0.25, 0, 1 / (rate_rps * 0.25))).pvalue < 1e-6


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_arrivals_follow_gamma_with_the_burstiness_as_shape(burstiness):
    rate_rps = 40.0
    times = _times(ArrivalProcess.GAMMA, RateSchedule.constant(rate_rps, 200.0), burstiness=burstiness)
    assert len(times) / 200.0 == pytest.approx(rate_rps, rel=0.05)
    gaps = np.diff(times)
    assert stats.kstest(gaps, "gamma", args=(burstiness, 0, 1 / (rate_rps * burstiness))).pvalue > 0.01
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)  # < 1 is burstier than Poisson


def test_constant_arrivals_are_evenly_spaced():
    times = _times(ArrivalProcess.CONSTANT, RateSchedule.constant(20.0, 5.0))
    assert len(times) == 99  # 0.05, 0.10, ... 4.95 (5.0 is the end, excluded)
    assert np.allclose(np.diff(times), 0.05)


def test_step_schedule_changes_the_rate_at_the_boundary():
    schedule = RateSchedule([Segment(50.0, 10.0, 10.0), Segment(50.0, 40.0, 40.0)])
    times = _times(ArrivalProcess.POISSON, schedule)
    assert np.sum(times < 50) / 50 == pytest.approx(10.0, rel=0.1)
    assert np.sum(times >= 50) / 50 == pytest.approx(40.0, rel=0.05)


def test_ramp_schedule_follows_the_integral_of_the_rate():
    schedule = RateSchedule([Segment(100.0, 0.0, 60.0)])  # expected arrivals by t: 0.3 t^2
    times = _times(ArrivalProcess.POISSON, schedule, seed=3)
    for t_s in (25.0, 50.0, 75.0, 100.0):
        expected = 0.3 * t_s**2
        assert abs(np.sum(times < t_s) - expected) < 4 * np.sqrt(expected)  # Poisson count: 4 sigma
    # Time-rescaled gaps are unit exponential.
    rescaled = np.diff([schedule.cumulative(t) for t in times])
    assert stats.kstest(rescaled, "expon").pvalue > 0.01


def test_zero_rate_segment_holds_no_arrivals():
    schedule = RateSchedule([Segment(1.0, 20.0, 20.0), Segment(2.0, 0.0, 0.0), Segment(1.0, 20.0, 20.0)])
    times = _times(ArrivalProcess.CONSTANT, schedule)
    assert not np.any((times > 1.0) & (times < 3.0))
    assert len(times) == 39


def test_arrivals_are_reproducible_with_a_seed():
    schedule = RateSchedule.constant(30.0, 10.0)
    assert np.array_equal(_times(ArrivalProcess.POISSON, schedule, 5), _times(ArrivalProcess.POISSON, schedule, 5))


def test_segment_rejects_negative_rates_and_empty_durations():
    with pytest.raises(ValueError, match="duration_s must be > 0"):
        Segment(0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="rates must be >= 0"):
        Segment(1.0, -1.0, 1.0)
