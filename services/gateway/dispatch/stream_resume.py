"""Resuming a Generate stream on another scheduler after its upstream broke mid-stream.

Once a token reached the client, a failed attempt cannot simply be retried: the
client would see tokens twice. It is resumed instead, as a continuation
(scheduler.proto, GenerateContinuation): the same request, the version that
served the first chunk, and every token id delivered so far. The new scheduler
prefills prompt + those tokens, generates the rest, numbers its chunks on from
len(token_ids) and sends none of the text already delivered, so the client
reads one stream. Sampled streams resume identically because the gateway fixed
the seed before the first attempt and sampling is a function of (seed, position).

What resumes: UNAVAILABLE (transport lost, the Submit stream broke, a draining
scheduler handed the stream over), a stream that ended without its final
chunk, and a resume attempt that met a scheduler not serving the model
(NOT_FOUND: one just restarted, before its workers re-attached). A scheduler's other answers (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
INTERNAL, a negative pushback) end the stream: a continuation would meet the
same answer. Resumes are capped per stream and need the time for at least the
model's minimum service time before the deadline.

`ResumeState` is one stream's bookkeeping; pure logic, duck-typed chunks (any
object with token_ids, index, finish_reason, usage and model), no grpc.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from services.gateway.upstream.status import UpstreamCode

# The message a draining scheduler ends a handed-over stream with (its status is UNAVAILABLE, pushback 0).
DRAINING_PREFIX = "scheduler draining"
DEFAULT_MAX_RESUMES = 3
# Wait before the n-th resume (n from 0) when the scheduler gave no retry hint: workers re-dial a
# restarted scheduler within about half a second.
RESUME_BACKOFF_S = (0.0, 0.25, 0.5, 1.0)


class ResumeReason(enum.Enum):
    # Transport loss or a broken Submit stream: the scheduler is gone or unreachable.
    UNAVAILABLE = "unavailable"
    # A draining scheduler handed the stream over.
    DRAINING = "draining"
    # The upstream stream ended without its final chunk.
    CUT = "cut"
    # The scheduler tried does not serve the model (NOT_FOUND, e.g. just restarted): no work was done there.
    NOT_SERVED = "not_served"


class ResumeVerdict(enum.Enum):
    RESUME = "resume"
    NOT_RESUMABLE = "not_resumable"
    RESUMES_EXHAUSTED = "resumes_exhausted"
    DEADLINE = "deadline"


@dataclass(frozen=True)
class ResumeDecision:
    verdict: ResumeVerdict
    reason: ResumeReason | None = None
    # Wait before the resumed attempt; 0 unless verdict is RESUME.
    delay_s: float = 0.0

    @property
    def resume(self) -> bool:
        return self.verdict is ResumeVerdict.RESUME


class StreamMismatch(Exception):
    """An upstream chunk does not continue the stream the client has (a gap or a repeat)."""


def resume_reason(code: UpstreamCode, pushback_ms: int | None, message: str, *, cut: bool) -> ResumeReason | None:
    """Why a failed attempt may be resumed, or None when it may not."""
    if cut:
        return ResumeReason.CUT
    if code is UpstreamCode.NOT_FOUND:
        return ResumeReason.NOT_SERVED
    if code is not UpstreamCode.UNAVAILABLE or (pushback_ms is not None and pushback_ms < 0):
        return None
    return ResumeReason.DRAINING if message.startswith(DRAINING_PREFIX) else ResumeReason.UNAVAILABLE


class ResumeState:
    """What one Generate stream delivered, and whether and how it may resume."""

    def __init__(self, max_resumes: int = DEFAULT_MAX_RESUMES) -> None:
        if max_resumes < 0:
            raise ValueError(f"max_resumes must be >= 0, got {max_resumes}")
        self.max_resumes = max_resumes
        self.num_resumes = 0
        self._delivered: list[int] = []
        # The version that served the first chunk: a resume must continue on the same model.
        self.version = ""
        self.finished = False

    @property
    def num_delivered(self) -> int:
        return len(self._delivered)

    def continuation(self) -> tuple[int, ...]:
        """The token ids to send as GenerateContinuation.token_ids (empty before the first token)."""
        return tuple(self._delivered)

    def accept(self, chunk) -> None:
        """Records a chunk about to go to the client; raises StreamMismatch when it does not continue it.

        A resumed scheduler numbers its chunks on from the continuation, so a chunk's
        `index` must equal the tokens delivered so far: anything else would show the
        client a gap or a repeat.
        """
        token_ids: Sequence[int] = chunk.token_ids
        if token_ids and chunk.index != len(self._delivered):
            raise StreamMismatch(
                f"chunk at index {chunk.index} does not continue the {len(self._delivered)} tokens delivered")
        self._delivered.extend(token_ids)
        if not self.version and chunk.model.version:
            self.version = chunk.model.version
        if chunk.finish_reason:
            self.finished = True
            # A resumed scheduler counts the continuation's tokens too; never report fewer than were sent.
            if chunk.usage.completion_tokens < len(self._delivered):
                chunk.usage.completion_tokens = len(self._delivered)

    def decide(self, code: UpstreamCode, pushback_ms: int | None, message: str, *, cut: bool,
               remaining_s: float, min_service_time_s: float = 0.0) -> ResumeDecision:
        """After an attempt failed with tokens delivered: resume it, and after how long?
        Counts the resume when the answer is yes.

        The first resume goes at once (another scheduler is likely there), unless the scheduler
        gave a retry hint; later ones wait the hint or RESUME_BACKOFF_S: by then every scheduler
        was likely tried, and one just restarted needs a moment for its workers to re-attach.
        """
        reason = resume_reason(code, pushback_ms, message, cut=cut)
        if reason is None:
            return ResumeDecision(ResumeVerdict.NOT_RESUMABLE)
        if self.num_resumes >= self.max_resumes:
            return ResumeDecision(ResumeVerdict.RESUMES_EXHAUSTED, reason)
        if pushback_ms:
            delay_s = pushback_ms / 1000
        else:
            delay_s = RESUME_BACKOFF_S[min(self.num_resumes, len(RESUME_BACKOFF_S) - 1)]
        if delay_s + min_service_time_s >= remaining_s:
            return ResumeDecision(ResumeVerdict.DEADLINE, reason)
        self.num_resumes += 1
        return ResumeDecision(ResumeVerdict.RESUME, reason, delay_s)
