"""Retry budget per upstream: retries stay a small fraction of requests.

Finagle's RetryBudget shape: every original request deposits `retry_ratio` of a
retry into a sliding window, each retry withdraws one, and a floor of
`min_retries_per_s` lets a quiet gateway still retry. Over any window,

    retries <= min_retries_per_s * window_s + retry_ratio * requests

so when an upstream fails hard, retries add at most ~10% load on top of the
requests themselves instead of multiplying it by the attempt count.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.clock import Clock
from services.gateway.routing.sliding_window import SlidingWindowCounter


@dataclass(frozen=True)
class RetryBudgetConfig:
    retry_ratio: float = 0.1
    window_s: float = 10.0
    min_retries_per_s: float = 1.0
    num_slots: int = 10

    def __post_init__(self) -> None:
        if not 0 <= self.retry_ratio <= 1:
            raise ValueError(f"retry_ratio must be in [0, 1], got {self.retry_ratio}")
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.min_retries_per_s < 0:
            raise ValueError(f"min_retries_per_s must be >= 0, got {self.min_retries_per_s}")


class RetryBudget:
    def __init__(self, config: RetryBudgetConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._requests = SlidingWindowCounter(config.window_s, config.num_slots)
        self._retries = SlidingWindowCounter(config.window_s, config.num_slots)

    def record_request(self) -> None:
        """Count one original request (not a retry) sent to this upstream."""
        self._requests.add(self.clock())

    def balance(self) -> float:
        """Retries that may be spent now (may be fractional; one retry needs >= 1)."""
        now_s = self.clock()
        allowance = (
            self.config.min_retries_per_s * self.config.window_s
            + self.config.retry_ratio * self._requests.total(now_s)
        )
        return allowance - self._retries.total(now_s)

    def try_spend(self) -> bool:
        """Withdraw one retry if the budget has it."""
        if self.balance() < 1:
            return False
        self._retries.add(self.clock())
        return True


class RetryBudgets:
    """One budget per upstream endpoint, made on first use."""

    def __init__(self, config: RetryBudgetConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self._by_upstream: dict[str, RetryBudget] = {}

    def for_upstream(self, upstream: str) -> RetryBudget:
        budget = self._by_upstream.get(upstream)
        if budget is None:
            budget = self._by_upstream[upstream] = RetryBudget(self.config, self.clock)
        return budget

    def forget(self, upstream: str) -> None:
        """`upstream` left discovery for good: its budget goes."""
        self._by_upstream.pop(upstream, None)

    def balances(self) -> dict[str, float]:
        """Budget left per upstream, for the `retry budget` gauge."""
        return {upstream: budget.balance() for upstream, budget in self._by_upstream.items()}
