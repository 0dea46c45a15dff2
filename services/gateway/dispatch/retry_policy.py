"""Whether and when the gateway retries a failed upstream attempt.

Only the gateway retries, and only when a retry cannot do harm:

* UNAVAILABLE before the upstream accepted the work: nothing was done
  (connection refused, no worker attached, draining scheduler).
* Classify is idempotent (same image, same model version, same answer; a
  duplicate costs compute, never correctness), so it may also retry
  UNAVAILABLE after acceptance (a scheduler that died mid-call) and ABORTED
  (gRPC's "concurrency conflict, retry at a higher level": a batch aborted
  because its worker's stream broke). It does not retry RESOURCE_EXHAUSTED
  (an overloaded upstream shedding load; retrying would defeat it),
  DEADLINE_EXCEEDED (the time is gone) or INTERNAL/UNKNOWN (possibly a
  deterministic failure of this input, which retries would multiply).
* A Generate stream that already sent a token to the client is never retried.

Retries are bounded by `max_attempts`, spaced by full-jitter exponential
backoff (gRPC A6), replaced by server pushback when given (a negative
pushback means "do not retry"), never scheduled past the deadline, and paid
for from the upstream's `RetryBudget`.

Failover is the exception to the budget. When the failed endpoint is provably
gone (`endpoint_gone`: a transport failure, UNAVAILABLE the scheduler did not
answer with a retry hint, or a draining scheduler's UNAVAILABLE with pushback
0), or it does not serve the model (NOT_FOUND "not served here": a scheduler
just restarted, before its workers re-attached and the next poll said so), and
the call has an endpoint it has not tried yet, it is re-sent there at
once, free of the budget and of `max_attempts`. Otherwise one dead replica
would fail most of its share of the load: the budget allows about 10% retries,
and the dead replica took 1/N of the calls. Failovers cannot storm: each goes to
an endpoint the call has not tried (at most N-1 per call), a dead endpoint's
breaker opens after a few failures and takes it out of routing, and the
deadline still bounds them. A live scheduler's answers (RESOURCE_EXHAUSTED,
DEADLINE_EXCEEDED, INTERNAL, UNAVAILABLE with a pushback > 0 such as "no
worker") stay ordinary retries, paid from the budget: retries against a live
but struggling replica stay a bounded fraction of its requests.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.dispatch.retry_budget import RetryBudget
from services.gateway.upstream.status import UpstreamCode


class WorkKind(enum.Enum):
    CLASSIFY = "classify"
    GENERATE = "generate"


@dataclass(frozen=True)
class AttemptFailure:
    code: UpstreamCode
    # The upstream had accepted the work (unary: any answer from the scheduler's handler
    # other than a transport failure; stream: initial metadata or a chunk was received).
    accepted: bool
    # Generate: tokens already forwarded to the client.
    num_tokens_sent: int = 0
    # The `grpc-retry-pushback-ms` trailer: None when absent; negative when the server
    # asks not to be retried.
    pushback_ms: int | None = None
    # The endpoint is gone or leaving, or does not serve the model (see the module doc): not a
    # live scheduler's answer about this call.
    endpoint_gone: bool = False


class RetryVerdict(enum.Enum):
    RETRY = "retry"
    # Re-sent at once to an endpoint not tried yet, free of the budget: the failed one is gone.
    FAILOVER = "failover"
    NOT_RETRYABLE = "not_retryable"
    TOKENS_SENT = "tokens_sent"
    PUSHBACK_STOP = "pushback_stop"
    ATTEMPTS_EXHAUSTED = "attempts_exhausted"
    DEADLINE = "deadline"
    BUDGET_EXHAUSTED = "budget_exhausted"


@dataclass(frozen=True)
class RetryDecision:
    verdict: RetryVerdict
    # Wait before the next attempt; 0 unless verdict is RETRY.
    delay_s: float = 0.0

    @property
    def retry(self) -> bool:
        return self.verdict in (RetryVerdict.RETRY, RetryVerdict.FAILOVER)


@dataclass(frozen=True)
class RetryPolicyConfig:
    max_attempts: int = 3
    initial_backoff_s: float = 0.025
    max_backoff_s: float = 0.5
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 < initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s} and {self.max_backoff_s}"
            )
        if self.backoff_multiplier < 1:
            raise ValueError(f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")


_ALWAYS_RETRYABLE_BEFORE_ACCEPTANCE = frozenset({UpstreamCode.UNAVAILABLE})
_IDEMPOTENT_RETRYABLE = frozenset({UpstreamCode.UNAVAILABLE, UpstreamCode.ABORTED})


class RetryPolicy:
    def __init__(
        self, config: RetryPolicyConfig | None = None, rng: Callable[[], float] = random.random
    ) -> None:
        self.config = config or RetryPolicyConfig()
        self._rng = rng

    def is_retryable(self, work: WorkKind, failure: AttemptFailure) -> bool:
        if work is WorkKind.GENERATE and failure.num_tokens_sent > 0:
            return False
        if work is WorkKind.CLASSIFY:
            return failure.code in _IDEMPOTENT_RETRYABLE
        return failure.code in _ALWAYS_RETRYABLE_BEFORE_ACCEPTANCE and not failure.accepted

    def backoff_s(self, num_attempts: int) -> float:
        """Full-jitter delay after `num_attempts` attempts: uniform in [0, cap)."""
        cap_s = min(
            self.config.initial_backoff_s * self.config.backoff_multiplier ** (num_attempts - 1),
            self.config.max_backoff_s,
        )
        return self._rng() * cap_s

    def decide(
        self,
        *,
        work: WorkKind,
        failure: AttemptFailure,
        num_attempts: int,
        remaining_s: float,
        budget: RetryBudget,
        min_service_time_s: float = 0.0,
        can_fail_over: bool = False,
    ) -> RetryDecision:
        """Retry after `num_attempts` attempts (>= 1) failed, with `remaining_s` until the deadline?

        can_fail_over: the call has an endpoint it has not tried that may be called now.
        The budget is charged only when the answer is RETRY.
        """
        if num_attempts < 1:
            raise ValueError(f"num_attempts must be >= 1, got {num_attempts}")
        if work is WorkKind.GENERATE and failure.num_tokens_sent > 0:
            return RetryDecision(RetryVerdict.TOKENS_SENT)
        # Before the retryable check: a scheduler that does not serve the model (NOT_FOUND) did no
        # work, and neither did one that is gone, whatever the code says about the call.
        if failure.endpoint_gone and can_fail_over:
            if min_service_time_s >= remaining_s:
                return RetryDecision(RetryVerdict.DEADLINE)
            return RetryDecision(RetryVerdict.FAILOVER)
        if not self.is_retryable(work, failure):
            return RetryDecision(RetryVerdict.NOT_RETRYABLE)
        if failure.pushback_ms is not None and failure.pushback_ms < 0:
            return RetryDecision(RetryVerdict.PUSHBACK_STOP)
        if num_attempts >= self.config.max_attempts:
            return RetryDecision(RetryVerdict.ATTEMPTS_EXHAUSTED)
        if failure.pushback_ms is not None:
            delay_s = failure.pushback_ms / 1000  # the server knows its recovery time better than we do
        else:
            delay_s = self.backoff_s(num_attempts)
        # A retry that cannot finish before the deadline only adds load.
        if delay_s + min_service_time_s >= remaining_s:
            return RetryDecision(RetryVerdict.DEADLINE)
        if not budget.try_spend():
            return RetryDecision(RetryVerdict.BUDGET_EXHAUSTED)
        return RetryDecision(RetryVerdict.RETRY, delay_s=delay_s)
