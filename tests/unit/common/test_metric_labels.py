from __future__ import annotations

import pytest

from services.common.metric_labels import OTHER, FirstSeen, KnownValues


def test_known_values_pass_and_everything_else_is_other():
    label = KnownValues({"digits", "tinylm"}.__contains__)
    assert [label("digits"), label("tinylm"), label("made-up"), label("")] == ["digits", "tinylm", OTHER, OTHER]


def test_first_seen_keeps_the_first_values_and_pools_the_rest():
    label = FirstSeen(limit=2)
    assert [label("a"), label("b"), label("c"), label("a"), label("d")] == ["a", "b", OTHER, "a", OTHER]
    assert len({label(f"flood-{i}") for i in range(10_000)}) == 1


def test_first_seen_needs_a_positive_limit():
    with pytest.raises(ValueError, match="limit must be >= 1"):
        FirstSeen(0)
