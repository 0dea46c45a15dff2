"""Which scheduler replica serves a model's next call: membership, affinity, pressure.

Without a routing file every discovered scheduler may serve every model. Three
questions pick one for a call:

1. Who serves the model? `Membership` keeps, per endpoint, the models its last
   ListModels reported ready. The candidates are the live endpoints serving the
   model; when none is known to (startup, a model whose workers are all
   re-attaching) every live endpoint is a candidate: fail open, the scheduler
   answers "no worker" itself. An endpoint whose last poll failed is chosen only
   when no other is available (it is probably dead; its breaker may not know yet).
2. Which one is preferred? Rendezvous (highest-random-weight) hashing of the
   model name over the candidates: every gateway prefers the same replica for a
   model, and losing or adding one replica moves only the models it preferred.
   One replica holding a model's whole queue is what keeps tenant shares exact
   (see docs/gateway.md, "Several schedulers").
3. Spill when clearly busier: the preferred replica keeps the call unless its
   fresh pressure report shows it clearly worse than the least loaded
   alternative (estimated queue time for the call's priority at least
   `spill_queue_ratio` times and `spill_queue_margin_s` more; or KV usage at
   `spill_kv_usage` or more while the other's is below; or no workers while the
   other has some). Without fresh reports nothing spills (fail open).

A Generate with a TTFT target first drops the candidates whose fresh report predicts a first
token past the target for its class (docs/gateway.md, "Latency objectives"); the questions above
then pick among those that can meet it, so the preferred (cache-warm) replica still wins when it
can. When none can, all stay candidates (admission already refused what surely misses).

The circuit breaker and the call's already-tried endpoints are applied by the
caller (routing/table.py) before the choice: they decide who is a candidate at all.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.common.priority import Priority
from services.gateway.routing.pressure import PressureReport


class Membership:
    """Live endpoints (from discovery) and the models each reported ready (from ListModels)."""

    def __init__(self, live: Callable[[], Sequence[str]]) -> None:
        self._live = live
        self._ready: dict[str, frozenset[str]] = {}
        self._unreachable: set[str] = set()
        # model -> (live endpoints, generation, candidates): candidates() runs for every call, while
        # what it depends on changes about once a poll interval at most.
        self._cached: dict[str, tuple[Sequence[str], int, tuple[str, ...]]] = {}
        self._generation = 0

    def live(self) -> tuple[str, ...]:
        return tuple(self._live())

    def update(self, endpoint: str, ready_models: Iterable[str]) -> None:
        """One successful poll of `endpoint`: the model names it serves with a ready worker."""
        ready = frozenset(ready_models)
        if self._ready.get(endpoint) != ready or endpoint in self._unreachable:
            self._ready[endpoint] = ready
            self._unreachable.discard(endpoint)
            self._generation += 1

    def not_serving(self, endpoint: str, model: str) -> None:
        """A call found `endpoint` not serving `model` (NOT_FOUND); the next poll says again."""
        ready = self._ready.get(endpoint, frozenset())
        if model in ready:
            self._ready[endpoint] = ready - {model}
            self._generation += 1

    def unreachable(self, endpoint: str) -> None:
        """Its poll failed: keep what it served, but try it after the others."""
        if endpoint not in self._unreachable:
            self._unreachable.add(endpoint)
            self._generation += 1

    def has_alternative(self, endpoint: str) -> bool:
        """Is another live endpoint answering polls? (Failing calls over needs somewhere to go.)"""
        return any(e != endpoint and e not in self._unreachable for e in self._live())

    def reachable(self, endpoint: str) -> bool:
        """False while its last poll failed."""
        return endpoint not in self._unreachable

    def forget(self, endpoint: str) -> None:
        """Left discovery: nothing is known about it any more."""
        self._ready.pop(endpoint, None)
        self._unreachable.discard(endpoint)
        self._generation += 1

    def serves(self, endpoint: str, model: str) -> bool:
        """Its last poll said it serves `model` with a ready worker."""
        return model in self._ready.get(endpoint, ())

    def candidates(self, model: str) -> tuple[str, ...]:
        """Every live endpoint: reachable ones serving `model` ready first, then the other reachable
        ones, then the unreachable ones.

        The others are the fallback when no serving one may be called: nobody reachable serves it
        (its schedulers died, a restarted one's workers are still re-attaching), or the serving
        ones' breakers are open (a half-open probe in flight during a roll). A call then gets a
        live scheduler's own answer ("not served here", "draining"), which the dispatcher regroups
        on, rather than "circuit open" at once."""
        live = self._live()
        cached = self._cached.get(model)
        if cached is not None and cached[0] is live and cached[1] == self._generation:
            return cached[2]
        candidates = tuple(sorted(live, key=lambda e: (e in self._unreachable, not self.serves(e, model))))
        self._cached[model] = (live, self._generation, candidates)
        return candidates


def rendezvous_order(model: str, endpoints: Iterable[str]) -> list[str]:
    """Endpoints by descending hash of (model, endpoint): the first is the model's preferred replica."""
    return list(_rendezvous_order(model, tuple(endpoints)))


@functools.lru_cache(maxsize=4096)
def _rendezvous_order(model: str, endpoints: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(sorted(endpoints, key=lambda e: _weight(model, e), reverse=True))


def _weight(model: str, endpoint: str) -> bytes:
    # A stable hash (not Python's salted hash()): every gateway process must agree.
    return hashlib.blake2b(f"{model}\0{endpoint}".encode(), digest_size=8).digest()


@dataclass(frozen=True)
class SpillPolicy:
    # The preferred replica's queue time must be this many times the other's...
    spill_queue_ratio: float = 2.0
    # ...and this much longer, so tiny queues never move a model.
    spill_queue_margin_s: float = 0.1
    # KV usage at which a generator replica counts as full.
    spill_kv_usage: float = 0.9

    def __post_init__(self) -> None:
        if self.spill_queue_ratio < 1:
            raise ValueError(f"spill_queue_ratio must be >= 1, got {self.spill_queue_ratio}")
        if self.spill_queue_margin_s < 0:
            raise ValueError(f"spill_queue_margin_s must be >= 0, got {self.spill_queue_margin_s}")
        if not 0 < self.spill_kv_usage <= 1:
            raise ValueError(f"spill_kv_usage must be in (0, 1], got {self.spill_kv_usage}")

    def clearly_busier(self, a: PressureReport, b: PressureReport, priority: Priority) -> bool:
        """Is replica `a` clearly more loaded than `b` for a call of `priority`?"""
        if a.num_workers == 0 and b.num_workers > 0:
            return True
        if a.kv_usage >= self.spill_kv_usage > b.kv_usage:
            return True
        queue_a_s, queue_b_s = a.queue_time_s(priority), b.queue_time_s(priority)
        return queue_a_s >= self.spill_queue_ratio * queue_b_s and queue_a_s - queue_b_s >= self.spill_queue_margin_s


def choose_replica(
    model: str,
    candidates: Sequence[str],
    pressure: Callable[[str], PressureReport | None],
    priority: Priority,
    policy: SpillPolicy,
    ttft_target_s: float | None = None,
) -> str:
    """The preferred replica of `model` among `candidates` (non-empty), unless another is clearly less loaded.

    ttft_target_s: only replicas predicted to meet it are considered, when any is."""
    ordered = rendezvous_order(model, candidates)
    if ttft_target_s is not None and len(ordered) > 1:
        ordered = [e for e in ordered if _may_meet(pressure(e), priority, ttft_target_s)] or ordered
    preferred = ordered[0]
    preferred_report = pressure(preferred)
    if preferred_report is None or len(ordered) == 1:
        return preferred
    best, best_report = preferred, preferred_report
    for endpoint in ordered[1:]:
        report = pressure(endpoint)
        if report is not None and policy.clearly_busier(best_report, report, priority):
            best, best_report = endpoint, report
    return best


def _may_meet(report: PressureReport | None, priority: Priority, ttft_target_s: float) -> bool:
    predicted_s = None if report is None else report.ttft_s(priority)
    return predicted_s is None or predicted_s <= ttft_target_s  # no prediction: fail open


class EndpointPressure(Protocol):
    def report(self, endpoint: str, model: str) -> PressureReport | None:
        """`endpoint`'s fresh pressure for `model`, None when it has none."""


class ReplicaSelector:
    """Membership plus the pressure board: what routing/table.py asks for models without a route."""

    def __init__(self, membership: Membership, board: EndpointPressure | None = None,
                 policy: SpillPolicy | None = None) -> None:
        self.membership = membership
        self._board = board
        self._policy = policy or SpillPolicy()

    def choose(self, model: str, available: Sequence[str], priority: Priority,
               ttft_target_s: float | None = None) -> str:
        membership = self.membership
        reachable = [e for e in available if membership.reachable(e)]
        available = [e for e in reachable if membership.serves(e, model)] or reachable or available
        board = self._board
        if board is None:
            return rendezvous_order(model, available)[0]
        return choose_replica(model, available, lambda e: board.report(e, model), priority, self._policy,
                              ttft_target_s)
