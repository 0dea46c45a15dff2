from __future__ import annotations

import pytest

from services.gateway.dispatch.retry_budget import RetryBudget, RetryBudgetConfig, RetryBudgets
from services.gateway.dispatch.retry_policy import (
    AttemptFailure,
    RetryPolicy,
    RetryPolicyConfig,
    RetryVerdict,
    WorkKind,
)
from services.gateway.routing.sliding_window import SlidingWindowCounter
from services.gateway.upstream.status import UpstreamCode

from .conftest import FixedRng

UNAVAILABLE_UNACCEPTED = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=False)

# --------------------------------------------------------------------------- sliding window


def test_window_forgets_slices_older_than_the_window():
    counter = SlidingWindowCounter(window_s=10.0, num_slots=10)
    counter.add(0.0, 5)
    counter.add(4.5, 3)
    assert counter.total(9.9) == 8
    assert counter.total(10.0) == 3  # the slice holding t=0 expired
    assert counter.total(15.0) == 0
    counter.add(100.0)  # a long idle gap clears everything at once
    assert counter.total(100.0) == 1


# --------------------------------------------------------------------------- budget


def run_sustained_failure(
    budget: RetryBudget, clock, rps: int, seconds: int, attempts: int = 3
) -> tuple[int, int]:
    """Every attempt fails; each request wants `attempts - 1` retries. Returns (requests, retries)."""
    num_requests = num_retries = 0
    for _ in range(seconds * rps):
        budget.record_request()
        num_requests += 1
        for _ in range(attempts - 1):
            if not budget.try_spend():
                break
            num_retries += 1
        clock.advance(1.0 / rps)
    return num_requests, num_retries


def test_budget_caps_retries_near_ten_percent_under_sustained_failure(clock):
    config = RetryBudgetConfig(retry_ratio=0.1, window_s=10.0, min_retries_per_s=1.0)
    budget = RetryBudget(config, clock)
    num_requests, num_retries = run_sustained_failure(budget, clock, rps=200, seconds=60)
    # Without a budget this would be 2 retries per request (200%).
    assert 0.09 <= num_retries / num_requests <= 0.11
    # Finagle's bound: ratio * requests + the floor over the run, plus one window's floor up front.
    assert num_retries <= 0.1 * num_requests + 1.0 * 60 + 1.0 * 10.0


def test_budget_floor_allows_min_retries_per_second_when_quiet(clock):
    budget = RetryBudget(RetryBudgetConfig(retry_ratio=0.1, window_s=10.0, min_retries_per_s=0.5), clock)
    spent = sum(budget.try_spend() for _ in range(20))
    assert spent == 5  # 0.5/s over a 10 s window, no requests at all
    clock.advance(10.0)
    assert budget.try_spend()  # the window moved on


def test_budget_is_per_upstream(clock):
    budgets = RetryBudgets(RetryBudgetConfig(retry_ratio=0.1, window_s=10.0, min_retries_per_s=0.1), clock)
    assert budgets.for_upstream("a:1").try_spend()
    assert not budgets.for_upstream("a:1").try_spend()
    assert budgets.for_upstream("b:1").try_spend()
    assert budgets.balances() == {"a:1": pytest.approx(0.0), "b:1": pytest.approx(0.0)}


# --------------------------------------------------------------------------- policy


@pytest.fixture
def budget(clock) -> RetryBudget:
    return RetryBudget(RetryBudgetConfig(min_retries_per_s=100.0), clock)


def make_policy(*draws: float, **over) -> RetryPolicy:
    config = RetryPolicyConfig(
        **{
            "max_attempts": 3,
            "initial_backoff_s": 0.1,
            "max_backoff_s": 0.3,
            "backoff_multiplier": 2.0,
            **over,
        }
    )
    return RetryPolicy(config, rng=FixedRng(*draws))


def test_retries_unavailable_before_acceptance_with_jittered_exponential_backoff(budget):
    policy = make_policy(0.5)
    first = policy.decide(
        work=WorkKind.GENERATE,
        failure=UNAVAILABLE_UNACCEPTED,
        num_attempts=1,
        remaining_s=10.0,
        budget=budget,
    )
    second = policy.decide(
        work=WorkKind.GENERATE,
        failure=UNAVAILABLE_UNACCEPTED,
        num_attempts=2,
        remaining_s=10.0,
        budget=budget,
    )
    assert first.retry and first.delay_s == pytest.approx(0.05)  # 0.5 * 0.1
    assert second.retry and second.delay_s == pytest.approx(0.10)  # 0.5 * 0.2


def test_backoff_is_capped_at_max_backoff():
    policy = make_policy(0.999)
    assert policy.backoff_s(10) == pytest.approx(0.2997)


def test_stops_after_max_attempts(budget):
    decision = make_policy().decide(
        work=WorkKind.CLASSIFY,
        failure=UNAVAILABLE_UNACCEPTED,
        num_attempts=3,
        remaining_s=10.0,
        budget=budget,
    )
    assert decision.verdict is RetryVerdict.ATTEMPTS_EXHAUSTED and not decision.retry


@pytest.mark.parametrize(
    ("work", "failure", "retryable"),
    [
        (WorkKind.GENERATE, AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=False), True),
        (WorkKind.GENERATE, AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=True), False),
        (WorkKind.GENERATE, AttemptFailure(UpstreamCode.ABORTED, accepted=False), False),
        (WorkKind.CLASSIFY, AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=True), True),
        (WorkKind.CLASSIFY, AttemptFailure(UpstreamCode.ABORTED, accepted=True), True),
        (WorkKind.CLASSIFY, AttemptFailure(UpstreamCode.RESOURCE_EXHAUSTED, accepted=True), False),
        (WorkKind.CLASSIFY, AttemptFailure(UpstreamCode.DEADLINE_EXCEEDED, accepted=True), False),
        (WorkKind.CLASSIFY, AttemptFailure(UpstreamCode.INTERNAL, accepted=True), False),
        (WorkKind.CLASSIFY, AttemptFailure(UpstreamCode.INVALID_ARGUMENT, accepted=True), False),
    ],
)
def test_retries_only_codes_that_prove_no_harm(budget, work, failure, retryable):
    decision = make_policy().decide(
        work=work, failure=failure, num_attempts=1, remaining_s=10.0, budget=budget
    )
    assert decision.retry is retryable
    if not retryable:
        assert decision.verdict is RetryVerdict.NOT_RETRYABLE


def test_never_retries_generate_once_a_token_was_sent(budget):
    failure = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=False, num_tokens_sent=1)
    decision = make_policy().decide(
        work=WorkKind.GENERATE, failure=failure, num_attempts=1, remaining_s=10.0, budget=budget
    )
    assert decision.verdict is RetryVerdict.TOKENS_SENT


def test_backoff_never_exceeds_remaining_deadline(budget):
    for draw in (0.0, 0.25, 0.5, 0.75, 0.999):
        for remaining_s in (0.01, 0.05, 0.1, 0.2, 0.35):
            for num_attempts in (1, 2):
                decision = make_policy(draw).decide(
                    work=WorkKind.CLASSIFY,
                    failure=UNAVAILABLE_UNACCEPTED,
                    num_attempts=num_attempts,
                    remaining_s=remaining_s,
                    budget=budget,
                    min_service_time_s=0.02,
                )
                if decision.retry:
                    assert decision.delay_s + 0.02 < remaining_s
                else:
                    assert decision.verdict is RetryVerdict.DEADLINE


def test_gives_up_when_backoff_would_pass_the_deadline(budget):
    decision = make_policy(0.9).decide(
        work=WorkKind.CLASSIFY,
        failure=UNAVAILABLE_UNACCEPTED,
        num_attempts=1,
        remaining_s=0.05,
        budget=budget,
    )
    assert decision.verdict is RetryVerdict.DEADLINE  # 0.09 s backoff > 0.05 s left


def test_honours_server_pushback_instead_of_backoff(budget):
    failure = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=False, pushback_ms=750)
    decision = make_policy(0.0).decide(
        work=WorkKind.CLASSIFY, failure=failure, num_attempts=1, remaining_s=10.0, budget=budget
    )
    assert decision.retry and decision.delay_s == 0.75


def test_pushback_past_the_deadline_is_not_retried(budget):
    failure = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=False, pushback_ms=2000)
    decision = make_policy().decide(
        work=WorkKind.CLASSIFY, failure=failure, num_attempts=1, remaining_s=1.0, budget=budget
    )
    assert decision.verdict is RetryVerdict.DEADLINE


def test_negative_pushback_means_do_not_retry(budget):
    failure = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=False, pushback_ms=-1)
    decision = make_policy().decide(
        work=WorkKind.CLASSIFY, failure=failure, num_attempts=1, remaining_s=10.0, budget=budget
    )
    assert decision.verdict is RetryVerdict.PUSHBACK_STOP


def test_budget_exhaustion_stops_retries_and_is_charged_only_on_retry(clock):
    budget = RetryBudget(RetryBudgetConfig(retry_ratio=0.0, window_s=10.0, min_retries_per_s=0.1), clock)
    policy = make_policy()
    not_retryable = AttemptFailure(UpstreamCode.INVALID_ARGUMENT, accepted=True)
    policy.decide(
        work=WorkKind.CLASSIFY, failure=not_retryable, num_attempts=1, remaining_s=10.0, budget=budget
    )
    assert budget.balance() == pytest.approx(1.0)  # nothing charged for a refusal

    kwargs = {
        "work": WorkKind.CLASSIFY,
        "failure": UNAVAILABLE_UNACCEPTED,
        "num_attempts": 1,
        "remaining_s": 10.0,
    }
    assert policy.decide(**kwargs, budget=budget).retry
    assert policy.decide(**kwargs, budget=budget).verdict is RetryVerdict.BUDGET_EXHAUSTED
