"""Which endpoints are polled fast: on their way back, until back in full, never for long."""

from __future__ import annotations

from services.gateway.routing.recovery_watch import (
    RECOVERY_POLL_S,
    RECOVERY_SETTLE_S,
    RECOVERY_WATCH_S,
    RecoveryWatch,
)

A = "10.0.0.1:50052"
B = "10.0.0.2:50052"


def _serving(clock, *models: str) -> RecoveryWatch:
    """A watch that has seen A serve `models` and let it go back to the whole-second schedule."""
    watch = RecoveryWatch(clock)
    watch.answered(A, models)
    clock.advance(RECOVERY_SETTLE_S)
    watch.answered(A, models)
    assert watch.watched([A]) == ()
    return watch


def test_a_restarted_scheduler_is_polled_fast_until_every_model_it_served_is_ready_again(clock):
    watch = _serving(clock, "digits", "tinylm")
    watch.failed(A)  # killed
    clock.advance(4.0)
    assert watch.watched([A]) == (A,), "watched while it does not answer"
    watch.answered(A, [])  # restarted, no worker attached yet
    clock.advance(RECOVERY_POLL_S)
    watch.answered(A, ["digits"])  # the classifier's worker re-dialled
    for _ in range(30):  # the generator's worker comes back 3 s later
        clock.advance(RECOVERY_POLL_S)
        watch.answered(A, ["digits"])
        assert watch.watched([A]) == (A,), "still polled fast: its generator is not back"
    watch.answered(A, ["digits", "tinylm"])
    assert watch.watched([A]) == ()


def test_a_model_that_never_returns_is_waited_for_at_most_the_watch_time(clock):
    watch = _serving(clock, "digits", "tinylm")
    watch.failed(A)
    clock.advance(30.0)  # down for long: the bound runs from its first answer
    watch.answered(A, ["digits"])  # tinylm's workers all went to another scheduler
    clock.advance(RECOVERY_WATCH_S - RECOVERY_POLL_S)
    watch.answered(A, ["digits"])
    assert watch.watched([A]) == (A,)
    clock.advance(RECOVERY_POLL_S)
    assert watch.watched([A]) == ()


def test_a_model_it_served_only_earlier_is_still_waited_for(clock):
    # The chaos timeline: A's generator worker is killed a second before A is; A's last answer
    # before it went away no longer listed the generator, which comes back to A when restarted.
    watch = _serving(clock, "digits", "tinylm")
    watch.answered(A, ["digits"])
    watch.failed(A)
    watch.answered(A, ["digits"])
    assert watch.watched([A]) == (A,)


def test_a_scheduler_frozen_and_thawed_with_its_workers_is_back_at_its_first_answer(clock):
    watch = _serving(clock, "digits")
    watch.failed(A)  # a poll timed out
    watch.answered(A, ["digits"])
    assert watch.watched([A]) == ()


def test_a_new_scheduler_is_polled_fast_until_its_ready_models_settle(clock):
    watch = RecoveryWatch(clock)
    assert watch.watched([A]) == (A,), "new: watched from the first sight"
    watch.answered(A, [])
    clock.advance(2 * RECOVERY_SETTLE_S)
    watch.answered(A, [])
    assert watch.watched([A]) == (A,), "nothing ready is not settled"
    watch.answered(A, ["digits"])
    clock.advance(RECOVERY_SETTLE_S / 2)
    watch.answered(A, ["digits", "tinylm"])  # still changing
    clock.advance(RECOVERY_SETTLE_S / 2)
    watch.answered(A, ["digits", "tinylm"])
    assert watch.watched([A]) == (A,)
    clock.advance(RECOVERY_SETTLE_S / 2)
    watch.answered(A, ["digits", "tinylm"])
    assert watch.watched([A]) == ()


def test_a_new_scheduler_that_never_answers_stays_watched_and_one_that_never_settles_does_not(clock):
    watch = RecoveryWatch(clock)
    assert watch.watched([A, B]) == (A, B)
    watch.failed(A)
    watch.answered(B, [])
    clock.advance(RECOVERY_WATCH_S)
    assert watch.watched([A, B]) == (A,)


def test_a_scheduler_discovered_later_is_watched_from_then(clock):
    watch = _serving(clock, "digits")
    clock.advance(3 * RECOVERY_WATCH_S)
    assert watch.watched([A, B]) == (B,)
