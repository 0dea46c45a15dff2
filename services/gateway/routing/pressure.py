"""The schedulers' pressure, as the gateway last heard it: one report per (scheduler, model).

The pressure poller (pressure_poller.py) writes it once a poll; routing (replicas.py: spill to a
less loaded replica), admission (shedding.py, the deadline check) and the dispatcher (is there time
for a retry?) read it on every request. Kept apart from the shedding decision so that routing
reads pressure without depending on admission.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.common.clock import Clock
from services.common.priority import Priority


@dataclass(frozen=True)
class PressureReport:
    """One scheduler's pressure for one model (domain twin of infermesh.v1.ModelPressure)."""

    model: str
    est_queue_time_s: Mapping[Priority, float]
    queue_depth: int = 0
    kv_usage: float = 0.0
    num_workers: int = 0
    min_service_time_s: float = 0.0
    # Requests the model's workers hold at once without queueing (0: unknown).
    num_slots: int = 0
    # Generate: predicted time to first token of a new one-token prompt per class, seconds; empty: not
    # predicted (a classifier, or an older scheduler).
    predicted_ttft_s: Mapping[Priority, float] = field(default_factory=dict)
    # The least TTFT any request could have: one step computing one token alone, seconds; 0: unknown.
    min_ttft_s: float = 0.0
    # How much predicted_ttft_s of each class grows per stream queued ahead of it since the report, seconds;
    # empty: not reported (an older scheduler: the prediction stands until the next poll).
    ttft_per_queued_s: Mapping[Priority, float] = field(default_factory=dict)
    # How much a new stream's predicted TTFT grows per token of its own prompt, seconds; 0: unknown.
    ttft_per_prompt_token_s: float = 0.0

    @classmethod
    def from_fields(
        cls,
        model: str,
        est_queue_time_us: Sequence[int],
        queue_depth: int,
        kv_usage: float,
        num_workers: int,
        min_service_time_us: int,
        num_slots: int = 0,
        predicted_ttft_us: Sequence[int] = (),
        min_ttft_us: int = 0,
        ttft_per_queued_us: Sequence[int] = (),
        ttft_per_prompt_token_ns: int = 0,
    ) -> PressureReport:
        """From ModelPressure's field values; `est_queue_time_us` is indexed by Priority number."""
        queue_s = {p: (est_queue_time_us[p] / 1e6 if p < len(est_queue_time_us) else 0.0) for p in Priority}
        return cls(
            model=model,
            est_queue_time_s=queue_s,
            queue_depth=queue_depth,
            kv_usage=kv_usage,
            num_workers=num_workers,
            min_service_time_s=min_service_time_us / 1e6,
            num_slots=num_slots,
            # 0 is no prediction: every prediction holds at least one step.
            predicted_ttft_s={p: predicted_ttft_us[p] / 1e6 for p in Priority
                              if p < len(predicted_ttft_us) and predicted_ttft_us[p] > 0},
            min_ttft_s=min_ttft_us / 1e6,
            ttft_per_queued_s={p: ttft_per_queued_us[p] / 1e6 for p in Priority
                               if p < len(ttft_per_queued_us) and ttft_per_queued_us[p] > 0},
            ttft_per_prompt_token_s=max(0, ttft_per_prompt_token_ns) / 1e9,
        )

    def queue_time_s(self, priority: Priority) -> float:
        return self.est_queue_time_s.get(priority, 0.0)

    def ttft_s(self, priority: Priority) -> float | None:
        """Predicted TTFT of a new request of `priority`; None when not predicted."""
        return self.predicted_ttft_s.get(priority)


class PressureBoard:
    """Latest pressure per (scheduler endpoint, model), read per model name.

    Reads are on every request's path and updates arrive about once a second per
    endpoint, so the per-model aggregate is computed on update and reused until one
    of the reports in it goes stale.
    """

    def __init__(self, clock: Clock, *, max_report_age_s: float = 5.0) -> None:
        self.clock = clock
        self.max_report_age_s = max_report_age_s
        self._by_endpoint: dict[str, tuple[float, dict[str, list[PressureReport]]]] = {}
        # model -> (receive time of its oldest report, aggregate or None)
        self._aggregates: dict[str, tuple[float, PressureReport | None]] = {}
        # endpoint -> model -> streams sent there per class since its last update (predicted_ttft_s)
        self._sent: dict[str, dict[str, dict[Priority, int]]] = {}
        # endpoint -> this gateway's streams sent there with no first response yet (nothing_waiting)
        self._unstarted: dict[str, UnstartedStreams] = {}

    def update(self, endpoint: str, reports: Iterable[PressureReport]) -> None:
        """Replace everything known from `endpoint` with one fresh poll's reports."""
        by_model: dict[str, list[PressureReport]] = {}
        for report in reports:
            by_model.setdefault(report.model, []).append(report)
        self._by_endpoint[endpoint] = (self.clock(), by_model)
        self._aggregates.clear()
        self._sent.pop(endpoint, None)  # its reports count them now
        self._unstarted.setdefault(endpoint, UnstartedStreams()).polled()

    def forget(self, endpoint: str) -> None:
        """`endpoint` left discovery: its reports no longer count."""
        if self._by_endpoint.pop(endpoint, None) is not None:
            self._aggregates.clear()
        self._sent.pop(endpoint, None)
        if endpoint in self._unstarted:
            self._unstarted[endpoint].polled()  # no report now: its next one starts afresh

    def report(self, endpoint: str, model: str) -> PressureReport | None:
        """`endpoint`'s fresh pressure for `model` (best case over its versions), None if none."""
        entry = self._by_endpoint.get(endpoint)
        if entry is None or entry[0] < self.clock() - self.max_report_age_s:
            return None
        reports = entry[1].get(model)
        if not reports:
            return None
        return reports[0] if len(reports) == 1 else _best_case(model, reports)

    def pressure(self, model: str) -> PressureReport | None:
        """The model's best-case pressure over fresh reports (versions and endpoints), None if none.

        Best case per field: the gateway sheds only when every scheduler serving the
        model is under pressure.
        """
        oldest_allowed_s = self.clock() - self.max_report_age_s
        cached = self._aggregates.get(model)
        if cached is not None and cached[0] >= oldest_allowed_s:
            return cached[1]
        received, reports = [], []
        for received_s, by_model in self._by_endpoint.values():
            if received_s >= oldest_allowed_s and model in by_model:
                received.append(received_s)
                reports.extend(by_model[model])
        aggregate = _best_case(model, reports) if reports else None
        # With no fresh report, the answer (None) holds until the next update clears the cache.
        self._aggregates[model] = (min(received, default=float("inf")), aggregate)
        return aggregate

    def predicted_ttft_s(self, report: PressureReport | None, priority: Priority) -> float | None:
        """The best predicted TTFT of a new `priority` stream of the model now, None when not predicted: over the
        fresh reports of every endpoint serving it (`report` is the model's aggregate, pressure(), which the
        caller already read), each report's prediction plus its growth per queued stream for each stream of the
        class or a higher one sent to that endpoint since its last poll (sent()). Between two polls a burst would
        otherwise be admitted whole on the first one's prediction (bench_slo, tinylm at 2x: 10-20 batch streams
        per 100 ms poll, each predicted 0.5-4.7 s, waited up to 9.4 s); counted per endpoint, a poll of one
        scheduler resets only what was sent to it."""
        if report is None:
            return None
        if not self._sent:
            return report.ttft_s(priority)
        oldest_allowed_s = self.clock() - self.max_report_age_s
        best_s: float | None = None
        for endpoint, (received_s, by_model) in self._by_endpoint.items():
            if received_s < oldest_allowed_s:
                continue
            sent = self._sent.get(endpoint, {}).get(report.model)
            num_ahead = 0 if not sent else sum(n for p, n in sent.items() if p <= priority)
            for candidate in by_model.get(report.model, ()):
                predicted_s = candidate.ttft_s(priority)
                if predicted_s is None:
                    continue
                predicted_s += num_ahead * candidate.ttft_per_queued_s.get(priority, 0.0)
                if best_s is None or predicted_s < best_s:
                    best_s = predicted_s
        return best_s

    def nothing_waiting(self, model: str, priority: Priority, target_s: float) -> bool:
        """Whether a scheduler serving `model` has no stream waiting (UnstartedStreams.none_waiting: by its last
        poll's queue and this gateway's streams sent there) and predicts a new one-token `priority` stream starts
        there within `target_s`. Such a stream starts on that scheduler's next steps, so a miss admission would
        predict for it is its own (its prompt's prefill, estimated from its bytes; a correction learned from cold
        starts), not overload: refusing it as overloaded, with a retry hint, would be false (admission.py)."""
        oldest_allowed_s = self.clock() - self.max_report_age_s
        for endpoint, (received_s, by_model) in self._by_endpoint.items():
            if received_s < oldest_allowed_s:
                continue
            unstarted = self._unstarted.get(endpoint) or _NONE_UNSTARTED
            for candidate in by_model.get(model, ()):
                predicted_s = candidate.ttft_s(priority)
                if (predicted_s is not None and predicted_s <= target_s
                        and unstarted.none_waiting(model, candidate.queue_depth)):
                    return True
        return False

    def sent(self, endpoint: str, model: str, priority: Priority) -> SentStream:
        """A stream of `model` and `priority` went to `endpoint` (an attempt, a resume): it queues there ahead of
        the next ones of its class and the classes below until that endpoint's next poll reports it. The caller
        says when it starts (SentStream.started)."""
        by_class = self._sent.setdefault(endpoint, {}).setdefault(model, {})
        by_class[priority] = by_class.get(priority, 0) + 1
        unstarted = self._unstarted.setdefault(endpoint, UnstartedStreams())
        return SentStream(unstarted, model, unstarted.sent(model))

    def num_slots(self, model: str) -> int:
        """Requests the model's workers hold at once, over every scheduler serving it; 0 when unknown."""
        report = self.pressure(model)
        return 0 if report is None else report.num_slots

    def min_service_time_s(self, model: str) -> float:
        """Estimated minimum service time for deadline checks; 0 when unknown."""
        report = self.pressure(model)
        return 0.0 if report is None else report.min_service_time_s


@dataclass
class UnstartedStreams:
    """One endpoint's streams from this gateway with no first response yet, per model, split at its last poll:
    those sent before it (the poll may count them queued) and those sent since (it cannot)."""

    before_poll: dict[str, int] = field(default_factory=dict)
    since_poll: dict[str, int] = field(default_factory=dict)
    before_poll_at_poll: dict[str, int] = field(default_factory=dict)
    num_polls: int = 0

    def sent(self, model: str) -> int:
        """Counts a stream sent now; the poll count it was sent under, for started()."""
        self.since_poll[model] = self.since_poll.get(model, 0) + 1
        return self.num_polls

    def started(self, model: str, sent_under: int) -> None:
        counts = self.since_poll if sent_under == self.num_polls else self.before_poll
        counts[model] = max(0, counts.get(model, 0) - 1)

    def polled(self) -> None:
        """A poll's report arrived (or the endpoint's was dropped): every stream unstarted now was sent before it."""
        for model, num in self.since_poll.items():
            self.before_poll[model] = self.before_poll.get(model, 0) + num
        self.since_poll.clear()
        self.before_poll_at_poll = dict(self.before_poll)
        self.num_polls += 1

    def none_waiting(self, model: str, queue_depth: int) -> bool:
        """Whether no stream waits for a slot there, given its last poll's `queue_depth` for `model`: nothing sent
        since the poll waits, and the poll queued none, or at most this gateway's streams unstarted then, all of
        which have started since. The previous request's streams, once running, no longer keep a scheduler "busy"
        until its next poll; a queue holding other gateways' streams, which this one never sees start, stays busy
        (one of ours still on its way at the poll may hide one of theirs: the scheduler's own check, on its live
        queue, is the backstop); and one of ours still prefilling at the poll, not queued, does not hide a queued one."""
        if self.since_poll.get(model, 0):
            return False
        return queue_depth == 0 or (not self.before_poll.get(model, 0)
                                    and queue_depth <= self.before_poll_at_poll.get(model, 0))


_NONE_UNSTARTED = UnstartedStreams()


@dataclass
class SentStream:
    """One stream PressureBoard.sent() counted as waiting at its endpoint: started() when it no longer waits
    there (its first response, or its attempt ended without one). Only the first call counts."""

    unstarted: UnstartedStreams
    model: str
    sent_under: int  # the endpoint's poll count when it was sent
    done: bool = False

    def started(self) -> None:
        if not self.done:
            self.done = True
            self.unstarted.started(self.model, self.sent_under)


def _best_case(model: str, reports: list[PressureReport]) -> PressureReport:
    best = _best_ttft(reports)
    return PressureReport(
        model=model,
        est_queue_time_s={p: min(r.queue_time_s(p) for r in reports) for p in Priority},
        queue_depth=min(r.queue_depth for r in reports),
        kv_usage=min(r.kv_usage for r in reports),
        num_workers=sum(r.num_workers for r in reports),
        min_service_time_s=min(r.min_service_time_s for r in reports),
        num_slots=sum(r.num_slots for r in reports),
        predicted_ttft_s={p: r.predicted_ttft_s[p] for p, r in best.items()},
        min_ttft_s=min((r.min_ttft_s for r in reports if r.min_ttft_s > 0), default=0.0),
        ttft_per_queued_s={p: r.ttft_per_queued_s[p] for p, r in best.items() if p in r.ttft_per_queued_s},
        ttft_per_prompt_token_s=min((r.ttft_per_prompt_token_s for r in reports if r.ttft_per_prompt_token_s > 0),
                                    default=0.0),
    )


def _best_ttft(reports: list[PressureReport]) -> dict[Priority, PressureReport]:
    """Per class, the report with the least predicted TTFT among those that predict one: the best
    candidate's, whose growth per queued stream goes with it."""
    best: dict[Priority, PressureReport] = {}
    for report in reports:
        for priority, seconds in report.predicted_ttft_s.items():
            if priority not in best or seconds < best[priority].predicted_ttft_s[priority]:
                best[priority] = report
    return best
