"""Deadlines at the edge: default, clamp, per-hop margin and early rejection.

Every request leaves the gateway with a deadline: the client's (clamped to
`max_timeout_s`) or `default_timeout_s` when it set none. The scheduler gets
what remains minus `hop_margin_s`, so the gateway still has time to turn a
late upstream answer into a clean DEADLINE_EXCEEDED. A request whose
downstream budget is below the model's estimated minimum service time is
rejected before any work is spent on it, except one probe per model every
`estimate_probe_interval_s`: the estimate is measured from requests served, so
refusing all of them would freeze an estimate inflated by a passing overload
(once it exceeds the clients' deadlines, nothing would ever be admitted again).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.clock import Clock
from services.common.errors import DeadlineExceeded


@dataclass(frozen=True)
class DeadlinePolicy:
    default_timeout_s: float = 30.0
    max_timeout_s: float = 300.0
    # Kept back by the gateway at each downstream call, for its own reply path.
    hop_margin_s: float = 0.005
    # A request the service-time estimate would refuse is let through this often per model.
    estimate_probe_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.default_timeout_s > 0:
            raise ValueError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")
        if self.max_timeout_s < self.default_timeout_s:
            raise ValueError(
                f"max_timeout_s ({self.max_timeout_s}) must be >= default_timeout_s ({self.default_timeout_s})"
            )
        if not 0 <= self.hop_margin_s < self.default_timeout_s:
            raise ValueError(
                f"hop_margin_s must be in [0, default_timeout_s={self.default_timeout_s}), got {self.hop_margin_s}"
            )
        if self.estimate_probe_interval_s <= 0:
            raise ValueError(f"estimate_probe_interval_s must be > 0, got {self.estimate_probe_interval_s}")


@dataclass(frozen=True)
class Deadline:
    # On the gateway's monotonic clock, seconds.
    expires_at_s: float

    def remaining_s(self, now_s: float) -> float:
        """Time left, never negative."""
        return max(0.0, self.expires_at_s - now_s)


class Deadlines:
    def __init__(self, policy: DeadlinePolicy, clock: Clock) -> None:
        self.policy = policy
        self.clock = clock
        self._last_probe_s: dict[str, float] = {}

    def start(self, client_timeout_s: float | None) -> Deadline:
        """The request's deadline from the client's remaining time (None: it set none)."""
        if client_timeout_s is None:
            timeout_s = self.policy.default_timeout_s
        elif client_timeout_s <= 0:
            raise DeadlineExceeded("deadline already expired on arrival")
        else:
            timeout_s = min(client_timeout_s, self.policy.max_timeout_s)
        return Deadline(expires_at_s=self.clock() + timeout_s)

    def downstream_timeout_s(self, deadline: Deadline) -> float:
        """Timeout to give the next hop: remaining minus the margin; raises when nothing is left."""
        remaining_s = deadline.remaining_s(self.clock())
        budget_s = remaining_s - self.policy.hop_margin_s
        if budget_s <= 0:
            raise DeadlineExceeded(
                f"deadline exceeded: {remaining_s * 1000:.1f} ms left, "
                f"{self.policy.hop_margin_s * 1000:.1f} ms hop margin"
            )
        return budget_s

    def check_can_finish(self, deadline: Deadline, model_name: str, min_service_time_s: float) -> None:
        """Reject at once what the model cannot serve in the time left (0: no estimate yet)."""
        now_s = self.clock()
        remaining_s = deadline.remaining_s(now_s)
        budget_s = remaining_s - self.policy.hop_margin_s
        if budget_s > 0 and budget_s < min_service_time_s and self._may_probe(model_name, now_s):
            return
        if budget_s <= 0 or budget_s < min_service_time_s:
            raise DeadlineExceeded(
                f"deadline too short for model '{model_name}': {remaining_s * 1000:.1f} ms left, "
                f"estimated minimum service time {min_service_time_s * 1000:.1f} ms"
            )

    def _may_probe(self, model_name: str, now_s: float) -> bool:
        if now_s - self._last_probe_s.get(model_name, -float("inf")) < self.policy.estimate_probe_interval_s:
            return False
        if len(self._last_probe_s) > 10_000:  # model names come from clients
            self._last_probe_s.clear()
        self._last_probe_s[model_name] = now_s
        return True
