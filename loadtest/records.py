"""What happened to one request, as plain data the report is computed from.

Times are seconds from the run's start on the load generator's monotonic clock.
Latency is measured from the *scheduled* send time, so a request that had to
wait (for the generator, for a free slot, for the channel) is charged for the
wait: that is what a user arriving at that moment would have seen, and it is
what avoids coordinated omission. Service time, from the actual send, is kept
separately.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.scenario import RequestKind

OK = "OK"
# Statuses the harness itself assigns, next to the gRPC code names.
CANCELLED_AT_END = "CANCELLED"  # still in flight when the run's drain period ran out
STREAM_GAP = "STREAM_GAP"  # a chunk's index skipped or repeated tokens
STREAM_TRUNCATED = "STREAM_TRUNCATED"  # the stream ended without a finish_reason

# Stages that are totals of other stages; leaving them out of breakdowns keeps
# the stacked bars additive and stops tail attribution from always naming them.
AGGREGATE_STAGES = frozenset({"gateway", "scheduler"})
CLIENT_QUEUE = "client_queue"  # scheduled -> actually sent, on the load generator
CLIENT_NETWORK = "client_network"  # service time the servers did not account for
OTHER = "other"  # the rest of the latency no reported stage covers
INGRESS = "ingress"  # gateway: the client's send (x-request-start) until its handler ran


@dataclass(frozen=True)
class StageSample:
    stage: str  # common.proto Stage name without the prefix, lower case: "queue_wait"
    service: str
    duration_us: int


@dataclass(frozen=True)
class Outcome:
    """What the sender observed; times in the clock's own seconds."""

    status: str
    sent_s: float
    done_s: float
    message: str = ""
    stages: tuple[StageSample, ...] = ()
    server_total_us: int = 0
    server_ttft_us: int = 0
    chunk_times_s: tuple[float, ...] = ()  # receipt time of every chunk that carried tokens
    num_output_tokens: int = 0
    trace_id: str = ""  # the W3C trace id sent in `traceparent` (32 hex digits); "" when never sent
    text: str = ""  # generate: the reply's text, which a session's next turn resends


@dataclass(frozen=True)
class RequestRecord:
    seq: int
    class_name: str
    kind: RequestKind
    tenant: str
    priority: str
    scheduled_s: float
    sent_s: float
    done_s: float
    status: str
    measured: bool  # False during warm-up
    message: str = ""
    stages: tuple[StageSample, ...] = ()
    server_total_us: int = 0
    server_ttft_us: int = 0
    chunk_times_s: tuple[float, ...] = ()
    num_output_tokens: int = 0
    trace_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def latency_s(self) -> float:
        return self.done_s - self.scheduled_s

    @property
    def service_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def client_queue_s(self) -> float:
        return max(0.0, self.sent_s - self.scheduled_s)

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times_s[0] - self.scheduled_s if self.chunk_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT)."""
        if self.num_output_tokens < 2 or not self.chunk_times_s:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.num_output_tokens - 1)

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Gaps between successive token-carrying chunks."""
        times = self.chunk_times_s
        return tuple(b - a for a, b in zip(times, times[1:], strict=False))

    def stage_us(self) -> dict[str, int]:
        """Where the latency went: leaf stages summed over the services that reported them, the
        client-side stages, and `other` for what no stage covers, so the parts add up to the
        latency (unless servers report overlapping stages)."""
        totals: dict[str, int] = {CLIENT_QUEUE: round(self.client_queue_s * 1e6)}
        service_us = round(self.service_s * 1e6)
        if self.server_total_us > 0:
            # The gateway's ingress stage (x-request-start) is outside its total but inside the service time.
            ingress_us = sum(s.duration_us for s in self.stages if s.stage == INGRESS)
            totals[CLIENT_NETWORK] = max(0, service_us - self.server_total_us - ingress_us)
        for s in self.stages:
            if s.stage not in AGGREGATE_STAGES:
                totals[s.stage] = totals.get(s.stage, 0) + s.duration_us
        accounted_us = sum(totals.values()) - totals[CLIENT_QUEUE]
        totals[OTHER] = max(0, service_us - accounted_us)
        return totals


def make_record(seq: int, class_name: str, kind: RequestKind, tenant: str, priority: str,
                scheduled_s: float, outcome: Outcome, origin_s: float, measured: bool) -> RequestRecord:
    """Combines the plan with what the sender saw, shifting times so the run starts at 0."""
    return RequestRecord(
        seq=seq,
        class_name=class_name,
        kind=kind,
        tenant=tenant,
        priority=priority,
        scheduled_s=scheduled_s,
        sent_s=outcome.sent_s - origin_s,
        done_s=outcome.done_s - origin_s,
        status=outcome.status,
        measured=measured,
        message=outcome.message,
        stages=outcome.stages,
        server_total_us=outcome.server_total_us,
        server_ttft_us=outcome.server_ttft_us,
        chunk_times_s=tuple(t - origin_s for t in outcome.chunk_times_s),
        num_output_tokens=outcome.num_output_tokens,
        trace_id=outcome.trace_id,
    )
