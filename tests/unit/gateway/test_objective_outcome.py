"""Judging a served stream against its objective, and the smoothed TTFT means (admission/objective_outcome.py)."""

from __future__ import annotations

import pytest

from services.common.objectives import LatencyObjective
from services.gateway.admission.objective_outcome import (
    ObjectiveOutcome,
    StreamLatency,
    TtftMeans,
    judge,
    measure,
)

OBJECTIVE = LatencyObjective(ttft_ms=200.0, tpot_ms=50.0)


def test_ttft_is_arrival_to_first_token_and_tpot_the_gaps_after_it():
    assert measure(10.0, 10.15, 10.55, 9) == StreamLatency(ttft_s=pytest.approx(0.15), tpot_s=pytest.approx(0.05))
    assert measure(10.0, 10.15, 10.15, 1) == StreamLatency(ttft_s=pytest.approx(0.15), tpot_s=None)


@pytest.mark.parametrize(("ttft_s", "tpot_s", "outcome"), [
    (0.2, 0.05, ObjectiveOutcome.MET),
    (0.1, None, ObjectiveOutcome.MET),
    (0.3, 0.01, ObjectiveOutcome.MISSED_TTFT),
    (0.1, 0.06, ObjectiveOutcome.MISSED_TPOT),
    (0.3, 0.06, ObjectiveOutcome.MISSED_BOTH),
    (0.3, None, ObjectiveOutcome.MISSED_TTFT),
])
def test_a_stream_meets_its_objective_only_with_both_targets(ttft_s, tpot_s, outcome):
    assert judge(OBJECTIVE, StreamLatency(ttft_s, tpot_s)) is outcome


def test_means_start_at_the_first_value_then_follow_slowly_per_key():
    means = TtftMeans(smoothing=0.5)
    assert means.add("gen", "standard", "measured", 1.0) == 1.0
    assert means.add("gen", "standard", "measured", 2.0) == 1.5
    assert means.add("gen", "standard", "predicted", 0.4) == 0.4
    with pytest.raises(ValueError, match="smoothing must be in"):
        TtftMeans(smoothing=0.0)
