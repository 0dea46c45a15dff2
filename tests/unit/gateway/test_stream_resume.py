"""One stream's resume state: what continuation to send, index and usage stitching, when to resume."""

from __future__ import annotations

import pytest

from infermesh.v1 import common_pb2, gateway_pb2
from services.gateway.calls.generate_core import fix_seed
from services.gateway.dispatch.retry_budget import RetryBudget, RetryBudgetConfig
from services.gateway.dispatch.retry_policy import AttemptFailure, RetryPolicy, RetryVerdict, WorkKind
from services.gateway.dispatch.stream_resume import (
    RESUME_BACKOFF_S,
    ResumeReason,
    ResumeState,
    ResumeVerdict,
    StreamMismatch,
    resume_reason,
)
from services.gateway.upstream.status import UpstreamCode


def _chunk(index, *token_ids, version="", final=False, completion_tokens=0):
    chunk = gateway_pb2.GenerateResponse(index=index, token_ids=token_ids)
    chunk.model.version = version
    if final:
        chunk.finish_reason = common_pb2.FINISH_REASON_EOS
        chunk.usage.completion_tokens = completion_tokens
    return chunk


def test_the_continuation_is_every_token_delivered_in_order_over_coalesced_chunks():
    state = ResumeState()
    assert state.continuation() == ()
    state.accept(_chunk(0, 5, 6, 7, version="2"))
    state.accept(_chunk(3))  # a text-only chunk (held-back bytes completed) carries no ids
    state.accept(_chunk(3, 8))
    assert state.continuation() == (5, 6, 7, 8)
    assert state.version == "2", "pinned by the first chunk that named it"
    assert not state.finished


def test_a_chunk_that_would_repeat_or_skip_tokens_is_refused():
    state = ResumeState()
    state.accept(_chunk(0, 1, 2))
    with pytest.raises(StreamMismatch, match="index 1 does not continue the 2 tokens"):
        state.accept(_chunk(1, 2, 3))
    with pytest.raises(StreamMismatch, match="index 3"):
        state.accept(_chunk(3, 4))
    assert state.continuation() == (1, 2)


def test_the_final_chunk_counts_at_least_every_token_delivered():
    state = ResumeState()
    state.accept(_chunk(0, 1, 2))
    final = _chunk(2, 3, final=True, completion_tokens=1)
    state.accept(final)
    assert state.finished and final.usage.completion_tokens == 3
    generous = ResumeState()
    final = _chunk(0, 1, final=True, completion_tokens=4)  # tokens held back by a stop string count too
    generous.accept(final)
    assert final.usage.completion_tokens == 4


@pytest.mark.parametrize(("code", "pushback_ms", "message", "cut", "reason"), [
    (UpstreamCode.UNAVAILABLE, None, "scheduler stream to a:1 broke", False, ResumeReason.UNAVAILABLE),
    (UpstreamCode.UNAVAILABLE, 0, "scheduler draining: stream handed over", False, ResumeReason.DRAINING),
    (UpstreamCode.UNAVAILABLE, 1000, "no worker serves model tinylm", False, ResumeReason.UNAVAILABLE),
    (UpstreamCode.UNAVAILABLE, -1, "do not retry", False, None),
    (UpstreamCode.INTERNAL, None, "worker crashed", False, None),
    (UpstreamCode.INVALID_ARGUMENT, None, "continuation too long", False, None),
    (UpstreamCode.UNAVAILABLE, None, "ended early", True, ResumeReason.CUT),
])
def test_what_resumes(code, pushback_ms, message, cut, reason):
    assert resume_reason(code, pushback_ms, message, cut=cut) is reason


def test_resumes_are_capped_and_need_time_for_the_minimum_service_time():
    state = ResumeState(max_resumes=2)
    decide = lambda **kw: state.decide(UpstreamCode.UNAVAILABLE, None, "broke", cut=False, **kw)  # noqa: E731
    assert decide(remaining_s=1.0, min_service_time_s=1.0).verdict is ResumeVerdict.DEADLINE
    assert decide(remaining_s=1.0).verdict is ResumeVerdict.RESUME
    assert decide(remaining_s=1.0).verdict is ResumeVerdict.RESUME
    assert decide(remaining_s=1.0).verdict is ResumeVerdict.RESUMES_EXHAUSTED
    assert state.num_resumes == 2


def test_failover_verdict_needs_a_gone_endpoint_and_an_untried_one():
    policy = RetryPolicy()
    budget = RetryBudget(RetryBudgetConfig(retry_ratio=0, min_retries_per_s=0), clock=lambda: 0.0)
    gone = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=True, endpoint_gone=True)

    def decide(failure, can_fail_over, num_attempts=1):
        return policy.decide(work=WorkKind.CLASSIFY, failure=failure, num_attempts=num_attempts, remaining_s=5.0,
                             budget=budget, can_fail_over=can_fail_over).verdict

    assert decide(gone, True) is RetryVerdict.FAILOVER
    assert decide(gone, True, num_attempts=3) is RetryVerdict.FAILOVER, "not bound by max_attempts"
    assert decide(gone, False) is RetryVerdict.BUDGET_EXHAUSTED, "no other endpoint: an ordinary retry"
    live = AttemptFailure(UpstreamCode.UNAVAILABLE, accepted=True, pushback_ms=300)
    assert decide(live, True) is RetryVerdict.BUDGET_EXHAUSTED, "a live scheduler's answer pays"


def test_a_sampled_request_gets_a_seed_before_its_first_attempt_and_a_given_one_is_kept():
    sampled = common_pb2.SamplingParams(temperature=0.8)
    fix_seed(sampled, lambda: 2**63 - 1)
    assert sampled.seed == 2**63 - 1
    chosen = common_pb2.SamplingParams(temperature=0.8, seed=7)
    fix_seed(chosen, lambda: 1)
    assert chosen.seed == 7
    greedy = common_pb2.SamplingParams()
    fix_seed(greedy, lambda: 1)
    assert not greedy.HasField("seed")


def test_the_first_resume_goes_at_once_later_ones_wait_the_hint_or_a_backoff():
    state = ResumeState(max_resumes=3)

    def decide(pushback_ms=None, remaining_s=10.0):
        return state.decide(UpstreamCode.UNAVAILABLE, pushback_ms, "broke", cut=False, remaining_s=remaining_s)

    assert decide().delay_s == 0.0, "another scheduler is likely there"
    assert decide(pushback_ms=1000).delay_s == 1.0, "'no worker, retry after 1 s' from a scheduler just restarted"
    assert decide(pushback_ms=1000, remaining_s=1.0).verdict is ResumeVerdict.DEADLINE
    assert decide().delay_s == RESUME_BACKOFF_S[2]
    assert state.num_resumes == 3
