"""Adaptive concurrency limits per model: admit only what the upstream can finish in time.

A fixed cap on requests in flight is either too low (idle capacity) or too high (a
standing queue: every request waits, then misses its deadline). Each model gets a
limit that follows measured latency, like Netflix's Gradient2 and Envoy's adaptive
concurrency filter:

    gradient = clamp(tolerance * baseline_s / recent_s, 0.5, 1)
    limit    = smoothed(limit * gradient + headroom)

`recent_s` is the mean latency of the last window of samples, `baseline_s` a slow
average of those means that decays when it runs far above recent latency (so a
past overload does not become the new normal). While latency stays within
`tolerance` of the baseline the limit grows by `headroom` (sqrt(limit)) per
window, but only when the limit is what holds traffic back (in flight reached
half of it): an idle model keeps its limit. Deadlines add a signal Gradient2 does
not have: a window in which more than `max_late_fraction` of requests used more
than `late_fraction` of their deadline, or were refused upstream as too late or
too many (DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED), multiplies the limit by
`backoff`. A batching backend's latency rises with concurrency by design; these
two signals stop the rise where it starts to cost deadlines.

Latency growth alone never takes the limit below the model's slots, as its
schedulers report them (what its workers keep busy with): below that, latency grows
because the backend batches, not because a queue stands. The deadline signal may:
when full batches themselves take too long for the deadlines (a starved CPU), only
fewer requests in flight keep the served ones on time.

Priority classes share one limit by fraction: sheddable traffic is refused first,
at `share[SHEDDABLE]` of the limit, then standard, and critical may use all of it.
Beyond it the request is refused at once (RESOURCE_EXHAUSTED with a retry hint),
before any upstream call, unless its tenant holds less than its weighted share of
what the class's part leaves to its class (the part less the permits held at other
classes, shared by weight among the tenants holding permits at this class, itself
counted): then it is admitted. So inside a class, a flood that fills the limit cannot
shut a light tenant out, as the scheduler's fair queue lets no flood fill its queue;
the flood is the one refused until it is back under its share. Between classes the
parts decide as before. The limit is exceeded by at most the other tenants' shares of
their class's part, and only while the flood drains. Not thread-safe: the gateway's one
event loop calls it.

Held calls (gateway dispatch/hold.py). A sample is the latency of an upstream that served the
request: the time in which no scheduler could take it (an attempt that failed for want of one: gone,
draining, silent, not serving the model; the wait before the next; the hold) is left out, and a
request that ends so (its deadline ran out in the hold) is no sample at all, latency or lateness.
Otherwise a call held 2 s through an outage read as a 2 s upstream, and after a long outage the
limit had collapsed while the schedulers were healthy again. While it waits in the hold a request
gives its slot back (the hold's own cap, `--hold-max-calls`, bounds the waiting ones; the gateway's
`--max-in-flight` still counts them) and takes it again when it goes out, past the limit if need
be: it was admitted, and new requests are refused until there is room. So the limit bounds what is
upstream, the burst of held calls when a scheduler returns aside, which the hold's cap bounds.
Envoy's adaptive concurrency filter keeps a request's slot, and times its sample, from admission to
response through the router's retries and connection-pool waits; but Envoy holds no request for
seconds (no healthy host is an immediate 503), so there both stay short.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.common.clock import Clock
from services.common.errors import ResourceExhausted
from services.common.priority import Priority


class Outcome(enum.Enum):
    SUCCESS = "success"  # latency is a sample
    DROPPED = "dropped"  # the upstream refused it as too late or too much: a congestion signal
    IGNORED = "ignored"  # says nothing about load (bad input, cancelled by the client)


@dataclass(frozen=True)
class AdaptiveLimitConfig:
    initial_limit: int = 64
    min_limit: int = 4
    max_limit: int = 2048
    # Latency may reach `tolerance` x its baseline before the limit shrinks.
    tolerance: float = 1.5
    # Weight of each window's new limit (the rest is the old limit).
    smoothing: float = 0.2
    # Windows the baseline averages over (EWMA).
    baseline_windows: int = 50
    # A window closes after this long with at least `min_window_samples`, or after max_window_s.
    min_window_s: float = 0.05
    max_window_s: float = 1.0
    min_window_samples: int = 10
    # A request that used more than this fraction of its deadline counts as late.
    late_fraction: float = 0.5
    # More late or dropped requests than this fraction of a window: multiply the limit by `backoff`.
    max_late_fraction: float = 0.05
    backoff: float = 0.9
    # Fraction of the limit each class may fill.
    share: Mapping[Priority, float] = field(
        default_factory=lambda: {Priority.CRITICAL: 1.0, Priority.STANDARD: 0.9, Priority.SHEDDABLE: 0.6}
    )
    min_retry_after_s: float = 0.02

    def __post_init__(self) -> None:
        if not 1 <= self.min_limit <= self.initial_limit <= self.max_limit:
            raise ValueError(
                f"need 1 <= min_limit <= initial_limit <= max_limit, got {self.min_limit}, "
                f"{self.initial_limit}, {self.max_limit}"
            )
        if self.tolerance < 1:
            raise ValueError(f"tolerance must be >= 1, got {self.tolerance}")
        for name in ("smoothing", "late_fraction", "backoff"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.max_late_fraction < 1:
            raise ValueError(f"max_late_fraction must be in [0, 1), got {self.max_late_fraction}")
        if not 0 < self.min_window_s <= self.max_window_s:
            raise ValueError(f"need 0 < min_window_s <= max_window_s, got {self.min_window_s}, {self.max_window_s}")
        missing = [p.name.lower() for p in Priority if p not in self.share]
        if missing:
            raise ValueError(f"share needs a fraction for every priority; missing {', '.join(missing)}")
        if any(not 0 < s <= 1 for s in self.share.values()):
            raise ValueError(f"share values must be in (0, 1], got {dict(self.share)}")


@dataclass
class _Window:
    started_s: float
    num_samples: int = 0
    num_late: int = 0
    latency_sum_s: float = 0.0
    max_in_flight: int = 0


@dataclass
class _Holder:
    """What one tenant holds of a limit now, by class (a request may ask for a lower class than its tenant's)."""

    weight: int
    num_in_flight: int = 0
    num_by_priority: dict[Priority, int] = field(default_factory=dict)

    def add(self, priority: Priority, delta: int) -> None:
        self.num_in_flight += delta
        self.num_by_priority[priority] = self.num_by_priority.get(priority, 0) + delta



class LimitPermit:
    """One admitted request's slot; `done()` exactly once (extra calls are ignored).

    Time in which no scheduler could take the request is not upstream latency (module docstring,
    "Held calls"): the dispatcher marks each attempt (`attempt()`) and each time no scheduler could
    take it (`unserved()`), and returns the slot while it waits in the hold (`step_out()`, `step_in()`)."""

    __slots__ = ("_limit", "_tenant_id", "_priority", "_weight", "admitted_s", "_budget_s", "_sampled", "released",
                 "_unserved_s", "_unserved_since_s", "_attempt_s", "_stepped_out")

    def __init__(self, limit: AdaptiveLimit, tenant_id: str, priority: Priority, weight: int, admitted_s: float,
                 budget_s: float | None) -> None:
        self._limit = limit
        self._tenant_id = tenant_id
        self._priority = priority
        self._weight = weight
        self.admitted_s = admitted_s
        self._budget_s = budget_s
        self._sampled = False
        self.released = False
        # Seconds no scheduler could take the request (kept out of its sample), and since when it
        # has been so now (None: an attempt is out, or none failed for want of a scheduler).
        self._unserved_s = 0.0
        self._unserved_since_s: float | None = None
        self._attempt_s: float | None = None  # when the attempt out now began
        self._stepped_out = False

    def attempt(self) -> None:
        """An attempt goes upstream now: unserved time before it is no part of the sample."""
        now_s = self._limit._clock()
        if self._unserved_since_s is not None:
            self._unserved_s += max(0.0, now_s - self._unserved_since_s)
            self._unserved_since_s = None
        self._attempt_s = now_s

    def unserved(self, *, from_attempt: bool = False) -> None:
        """No scheduler can take the request now; `from_attempt`: the attempt out failed for want of
        one (gone, draining, silent, not serving the model), so its time is unserved too. Until the
        next attempt() its time is no part of the sample, and if it ends so it is no sample at all."""
        if self._unserved_since_s is None:
            began_s = self._attempt_s if from_attempt else None
            self._unserved_since_s = self._limit._clock() if began_s is None else began_s
        self._attempt_s = None

    def step_out(self) -> None:
        """The request waits in the hold: its slot goes back to the limit meanwhile."""
        if not self._stepped_out and not self.released:
            self._stepped_out = True
            self._limit._release(self._tenant_id, self._priority)

    def step_in(self) -> None:
        """The request leaves the hold: it takes its slot again, past the limit if need be (it was
        admitted; new requests are refused until the limit has room again)."""
        if self._stepped_out:
            self._stepped_out = False
            if self.released:  # done() came first (the request ended while held): nothing to take back
                return
            self._limit._take(self._tenant_id, self._priority, self._weight)

    def first_response(self) -> None:
        """Streams: the first chunk arrived; its latency is the sample (a stream's length is the client's choice)."""
        if not self._sampled:
            self._sampled = True
            self._limit._sample(self._latency_s(), self._budget_s, Outcome.SUCCESS)

    def unserved_s(self) -> float | None:
        """Seconds so far in which no scheduler could take the request (held, or failing over for want of
        one); None while it is so now (its time says nothing of the schedulers' speed yet)."""
        return None if self._unserved_since_s is not None else self._unserved_s

    @property
    def num_in_flight(self) -> int:
        """Requests in flight on this permit's limit now."""
        return self._limit.num_in_flight

    def done(self, outcome: Outcome) -> None:
        if self.released:
            return
        self.released = True
        if self._unserved_since_s is not None:
            outcome = Outcome.IGNORED  # it ended with no scheduler able to take it: no news of their load
        if not self._sampled and outcome is not Outcome.IGNORED:
            self._sampled = True
            self._limit._sample(self._latency_s(), self._budget_s, outcome)
        if not self._stepped_out:
            self._limit._release(self._tenant_id, self._priority)

    def _latency_s(self) -> float:
        return self._limit._clock() - self.admitted_s - self._unserved_s


class AdaptiveLimit:
    """The limit of one model."""

    def __init__(self, name: str, config: AdaptiveLimitConfig, clock: Clock) -> None:
        self.name = name
        self.config = config
        self._clock = clock
        self.limit = float(config.initial_limit)
        # The schedulers' slots for this model (set from their pressure reports); the limit's floor.
        self.num_slots = 0
        self.num_in_flight = 0
        # Who holds the requests in flight, by tenant; a holder leaves at zero.
        self._holders: dict[str, _Holder] = {}
        self.baseline_s: float | None = None
        self.recent_s: float | None = None
        self._window = _Window(clock())

    def class_limit(self, priority: Priority) -> int:
        return max(1, int(self.limit * self.config.share[priority]))

    def acquire(self, priority: Priority, budget_s: float | None, *, tenant_id: str = "",
                weight: int = 1) -> LimitPermit:
        """A permit, or ResourceExhausted at once when this class's part of the limit is full and the
        tenant already holds its weighted share of it (module docstring).

        `budget_s`: the time the request has (its deadline), for the lateness signal; None: unknown.
        `tenant_id`, `weight`: the caller's tenant and its weight in fair queueing.
        """
        allowed = self.class_limit(priority)
        if self.num_in_flight >= allowed and not self._under_fair_share(tenant_id, priority, weight, allowed):
            retry_after_s = max(self.config.min_retry_after_s, self.recent_s or 0.0)
            raise ResourceExhausted(
                f"overloaded: model '{self.name}' has {self.num_in_flight} requests in flight, the adaptive "
                f"limit for {priority.name.lower()} traffic is {allowed}; retry after {retry_after_s:.2f} s",
                retry_after_s=retry_after_s,
            )
        holder = self._take(tenant_id, priority, weight)
        holder.weight = weight  # the latest weight wins, as in the scheduler's fair queue
        return LimitPermit(self, tenant_id, priority, weight, self._clock(), budget_s)

    def _take(self, tenant_id: str, priority: Priority, weight: int) -> _Holder:
        """One more request of `tenant_id` in flight (`weight`: its tenant's, if it holds none now)."""
        holder = self._holders.get(tenant_id)
        if holder is None:
            holder = self._holders[tenant_id] = _Holder(weight)
        holder.add(priority, 1)
        self.num_in_flight += 1
        window = self._window
        window.max_in_flight = max(window.max_in_flight, self.num_in_flight)
        return holder

    def num_held_by(self, tenant_id: str) -> int:
        """Requests of `tenant_id` in flight on this limit, at every class."""
        holder = self._holders.get(tenant_id)
        return 0 if holder is None else holder.num_in_flight

    def _under_fair_share(self, tenant_id: str, priority: Priority, weight: int, allowed: int) -> bool:
        """Whether one more permit keeps the tenant within its weighted share of `allowed` less the
        permits held at other classes, shared among the tenants holding permits at `priority`."""
        own_held, room, total_weight = 0, allowed, weight
        for other_id, holder in self._holders.items():
            at_class = holder.num_by_priority.get(priority, 0)
            room -= holder.num_in_flight - at_class
            if other_id == tenant_id:
                own_held = at_class
            elif at_class:
                total_weight += holder.weight
        return (own_held + 1) * total_weight <= room * weight

    def _release(self, tenant_id: str, priority: Priority) -> None:
        self.num_in_flight -= 1
        holder = self._holders[tenant_id]
        holder.add(priority, -1)
        if holder.num_in_flight == 0:
            del self._holders[tenant_id]

    # -- learning ----------------------------------------------------------------

    def _sample(self, latency_s: float, budget_s: float | None, outcome: Outcome) -> None:
        now = self._clock()
        window = self._window
        if outcome is Outcome.DROPPED:
            window.num_late += 1
        else:
            window.num_samples += 1
            window.latency_sum_s += latency_s
            if budget_s is not None and latency_s > self.config.late_fraction * budget_s:
                window.num_late += 1
        self._maybe_close_window(now)

    def _maybe_close_window(self, now: float) -> None:
        config, window = self.config, self._window
        age_s = now - window.started_s
        num_events = window.num_samples + window.num_late
        if not ((age_s >= config.min_window_s and num_events >= config.min_window_samples)
                or (age_s >= config.max_window_s and num_events > 0)):
            return
        self._window = _Window(now, max_in_flight=self.num_in_flight)
        self._update(window, num_events)

    def _update(self, window: _Window, num_events: int) -> None:
        config = self.config
        if window.num_late > config.max_late_fraction * num_events:
            self._set_limit(self.limit * config.backoff)
            return
        if window.num_samples == 0:
            return
        recent_s = window.latency_sum_s / window.num_samples
        self.recent_s = recent_s
        if self.baseline_s is None:
            self.baseline_s = recent_s
        else:
            alpha = 2 / (config.baseline_windows + 1)
            self.baseline_s += alpha * (recent_s - self.baseline_s)
            if self.baseline_s > 2 * recent_s:  # latency fell far below the baseline: forget the old normal
                self.baseline_s *= 0.95
        if window.max_in_flight < self.limit / 2:
            return  # the limit held nothing back: no evidence that more would be fine
        gradient = max(0.5, min(1.0, config.tolerance * self.baseline_s / recent_s))
        target = self.limit * gradient + math.sqrt(self.limit)
        smoothed = self.limit + config.smoothing * (target - self.limit)
        if smoothed < self.limit:  # latency growth shrinks it at most down to the slots
            smoothed = max(smoothed, min(self.limit, float(self.num_slots)))
        self._set_limit(smoothed)

    def _set_limit(self, value: float) -> None:
        self.limit = min(float(self.config.max_limit), max(float(self.config.min_limit), value))


class AdaptiveLimits:
    """One AdaptiveLimit per model name, made on first use."""

    def __init__(self, config: AdaptiveLimitConfig, clock: Clock) -> None:
        self.config = config
        self._clock = clock
        self._by_model: dict[str, AdaptiveLimit] = {}

    def for_model(self, model: str) -> AdaptiveLimit:
        limit = self._by_model.get(model)
        if limit is None:
            limit = self._by_model[model] = AdaptiveLimit(model, self.config, self._clock)
        return limit

    def limits(self) -> dict[str, AdaptiveLimit]:
        return dict(self._by_model)
